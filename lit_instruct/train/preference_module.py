"""PreferenceLoRAModule: DPO, IPO, SimPO or ORPO with LoRA, on :class:`InstructLoRAModule`'s build.

Everything but the steps is :class:`~lit_instruct.train.module.InstructLoRAModule`'s: the model build
(families, LoRA variants, QLoRA, fused LoRA), optimizer, schedule, checkpoints and adapter writing.
A step runs the trunk once over a ``[chosen rows; rejected rows]`` batch
(:class:`~lit_instruct.data.preference_datamodule.PreferenceDataModule`) and sums each answer's
log-probability through the chunked lm_head path (:func:`~lit_instruct.loss.answer_logps.answer_logps`).

The reference (DPO, IPO; none with ``reference_free``) is the policy's own weights with the adapter
switched off (peft's ``disable_adapter``: the fused LoRA layers then run peft's path, which skips the
adapter), or, when training continues from an SFT adapter (``adapter``), that adapter's weights as
loaded, put in place of the trained ones for the reference pass: no second copy of the base. The
reference pass runs in eval mode (no dropout: the frozen model), without gradients. With
``precompute_reference`` it runs once per pair before training (:mod:`lit_instruct.data.reference_cache`),
and steps read its values from the batches.

Each micro-batch returns its pairs' *summed* loss; at the optimizer step the gradient is divided by
the pairs of the whole window on all ranks (as :mod:`lit_instruct.train.window` does by tokens), so
it is the gradient of the mean over every pair of the step. The NLL terms (ORPO, ``rpo_alpha``,
``sft``) are each micro-batch's token mean over its chosen answers, weighted by its pairs (equal to
TRL's on one batch; over a window, a pair-weighted mean of the micro-batches' token means). So are
the batch terms of ``aot`` and ``aot_unpaired`` (they sort the micro-batch's pairs, as TRL sorts a
device's batch).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.batch import num_response_tokens, num_tokens
from lit_instruct.distributed import full_tensor
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import PairLogps, answer_token_logps
from lit_instruct.loss.preference import (  # PreferenceConfig: importable from here too
    PreferenceConfig,
    PreferenceLoss,
)
from lit_instruct.train.module import InstructLoRAModule
from lit_instruct.train.window import gradient_factor, scale_gradients


def metric_names(loss: PreferenceLoss) -> list[str]:
    """The per-pair metrics ``loss`` reports (TRL's names), in its order (declared by the loss)."""
    return list(loss.metric_names)


@dataclass(frozen=True)
class PairTotals:
    """What one optimizer step (or one validation) saw, over all ranks."""

    loss_sum: float
    pairs: int
    tokens: int
    answer_tokens: int
    metric_sums: dict[str, float]

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.pairs, 1)

    def metrics(self) -> dict[str, float]:
        """Each per-pair metric averaged over every pair."""
        return {name: value / max(self.pairs, 1) for name, value in self.metric_sums.items()}


class PairWindow:
    """Sums of micro-batches (loss, pairs, tokens, per-pair metrics) until :meth:`close` totals them
    over ranks; tensors stay on the device until then."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._reset()

    def _reset(self) -> None:
        self._sums: torch.Tensor | None = None  # loss sum, then each metric's sum
        self._counts = [0, 0, 0]  # pairs, tokens, answer tokens

    def add(
        self, loss_sum: torch.Tensor, metric_sums: torch.Tensor, pairs: int, tokens: int, answer: int
    ) -> None:
        sums = torch.cat([loss_sum.detach().double().reshape(1), metric_sums.double()])
        self._sums = sums if self._sums is None else self._sums + sums
        self._counts = [a + b for a, b in zip(self._counts, (pairs, tokens, answer), strict=True)]

    def close(self, all_reduce_sum: Any, device: torch.device) -> PairTotals:
        """The totals over all ranks (``all_reduce_sum`` is a collective: every rank calls it)."""
        packed = torch.zeros(4 + len(self.names), dtype=torch.float64, device=device)
        packed[:3] = torch.tensor(self._counts, dtype=torch.float64)
        if self._sums is not None:
            packed[3:] = self._sums.to(device)
        values = all_reduce_sum(packed).tolist()
        self._reset()
        return PairTotals(
            values[3],
            round(values[0]),
            round(values[1]),
            round(values[2]),
            dict(zip(self.names, values[4:], strict=True)),
        )


class PreferenceLoRAModule(InstructLoRAModule):
    """:class:`InstructLoRAModule` trained on preference pairs: DPO (any of TRL's loss types), IPO,
    SimPO or ORPO (``preference``), every other setting as there. Logs TRL's metrics:
    ``train/rewards/chosen``, ``.../rejected``, ``.../accuracies``, ``.../margins``,
    ``train/logps/chosen``, ``.../rejected`` (and ORPO's and RPO's), and the same under ``val/`` with
    ``val/loss`` and ``val/pairs``.

    Args:
        preference: the loss and its coefficients (:class:`PreferenceConfig`).
        *args, **kwargs: :class:`InstructLoRAModule`'s (``adapter``: an SFT adapter to continue from;
            it is then the reference too, so the first step's DPO loss is ln 2, its rewards 0).
    """

    def __init__(self, *args: Any, preference: PreferenceConfig | None = None, **kwargs: Any) -> None:
        if isinstance(preference, dict):
            preference = PreferenceConfig(**preference)
        self.preference = preference or PreferenceConfig()
        self.preference_loss = self.preference.loss()  # checked before the model loads
        if kwargs.get("packing"):
            raise ConfigError("model.packing", "must be false for preference training: pairs are padded rows")
        if kwargs.get("neftune_noise_alpha") is not None:
            raise ConfigError(
                "model.neftune_noise_alpha", "applies to SFT: the pair losses take no embedding noise"
            )
        super().__init__(*args, **kwargs)
        self.hparams["preference"] = asdict(self.preference)
        self.pair_window = PairWindow(metric_names(self.preference_loss))
        self.val_sums: torch.Tensor | None = None
        self.reference_key = uuid.uuid4().hex  # names this module's precomputed reference values
        self.reference_adapter: dict[str, torch.Tensor] | None = None
        if self.hparams.get("adapter") is not None and self.preference_loss.needs_reference:
            self.reference_adapter = self._trainable_copy()  # before a checkpoint's weights load

    def configure_model(self) -> None:
        """As :class:`InstructLoRAModule`'s; when this shards the model (``fsdp_lora``), the SFT
        reference is taken again from the sharded parameters, which hold the adapter as loaded (on a
        ``low_memory_load`` rank, as received from rank 0; a checkpoint is restored only after):
        DTensors laid out as the parameters, so that the reference pass swaps shard for shard."""
        sharding = not self._sharded
        super().configure_model()
        if sharding and self._sharded and self.reference_adapter is not None:
            self.reference_adapter = self._trainable_copy()

    def _trainable_copy(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    # -- the reference --------------------------------------------------------------------------

    @contextmanager
    def reference_model(self) -> Iterator[None]:
        """The model as the reference: eval mode, and the adapter off (or the SFT adapter's weights
        in place of the trained ones, put back after)."""
        was_training = self.model.training
        self.model.eval()
        try:
            if self.reference_adapter is None:
                with self.model.disable_adapter():
                    yield
            else:
                with self._weights(self.reference_adapter):
                    yield
        finally:
            self.model.train(was_training)

    @contextmanager
    def _weights(self, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            trained = {name: params[name].detach().clone() for name in weights}
            for name, value in weights.items():
                params[name].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in trained.items():
                    params[name].copy_(value)

    def on_fit_start(self) -> None:
        """With ``precompute_reference``, the reference log-probabilities of every pair, once."""
        self._precompute_reference(("train", "val"))

    def on_validation_start(self) -> None:
        self._precompute_reference(("val",))  # ``validate`` alone: the held-out pairs (in fit: done)

    def _precompute_reference(self, splits: tuple[str, ...]) -> None:
        if not self.preference.precompute_reference:
            return
        data: Any = getattr(self.trainer, "datamodule", None)
        if not hasattr(data, "cache_reference"):
            raise ConfigError(
                "model.preference.precompute_reference",
                f"needs the pairs of a PreferenceDataModule, got {type(data).__name__}",
            )
        device, precision = self.device, self.trainer.precision_plugin

        def reference(batch: dict[str, Any]) -> torch.Tensor:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with torch.no_grad(), precision.forward_context(), self.reference_model():
                logps = self.pair_logps(batch)
            return torch.cat([logps.chosen, logps.rejected])

        def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
            return self.trainer.strategy.reduce(values.to(device), reduce_op="sum").cpu()

        trainer, start = self.trainer, time.perf_counter()
        computed = data.cache_reference(
            reference, self.reference_key, splits, trainer.world_size, trainer.global_rank, all_reduce_sum
        )
        if computed:
            rank_zero_info(
                f"lit-instruct: reference log-probabilities of {computed} pairs computed once, in "
                f"{time.perf_counter() - start:.1f} s"
            )

    # -- steps ----------------------------------------------------------------------------------

    def pair_logps(self, batch: dict[str, Any], hidden: torch.Tensor | None = None) -> PairLogps:
        """Each answer's summed log-probability (``hidden``: the trunk's, else computed here); with
        ``ld_alpha``, LD-DPO's weighted sums (the reference's too, precomputed or not)."""
        if "packed_segments" in batch:
            raise ValueError("preference batches are padded rows, not packed")
        if hidden is None:
            hidden = self.trunk(batch)[0]
        labels = batch["labels"][:, 1:]  # position p predicts p + 1
        head = self.lm_head
        bias = head.bias if hasattr(head, "bias") else None
        weight, whole_bias = full_tensor(head.weight), full_tensor(bias)
        assert weight is not None
        per_token = answer_token_logps(
            hidden[:, :-1], weight, labels, bias=whole_bias, transform=self.logit_transform
        )
        return PairLogps.from_tokens(per_token, labels, self.preference_loss.ld_alpha)

    def pair_losses(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The batch's summed loss over its counted pairs, the per-pair metrics' sums (in
        :attr:`PairWindow.names`' order), the counted pairs and their answers' tokens."""
        reference = None
        cached = batch.get("reference_logps") if self.preference.precompute_reference else None
        if self.preference_loss.needs_reference and cached is None:
            with torch.no_grad(), self.reference_model():
                reference = self.pair_logps(batch)
        hidden, aux = self.trunk(batch)
        policy = self.pair_logps(batch, hidden)
        if cached is not None:  # precompute_reference: only for losses with a reference
            sums = cached.to(policy.chosen.device, torch.float32)
            reference = PairLogps.from_batch(sums, torch.cat([policy.chosen_tokens, policy.rejected_tokens]))
        num_pairs = len(policy.chosen)
        keep = batch.get("pair_mask")
        if keep is None:
            keep = (batch["labels"][:num_pairs, 1:] != IGNORE_INDEX).any(dim=1)
        counted = int(batch["num_counted_pairs"]) if "num_counted_pairs" in batch else int(keep.sum())
        names = self.pair_window.names
        if counted == 0:  # only a rank's padding repeats: no loss, but a graph through the trunk
            return hidden.sum() * 0.0, hidden.new_zeros(len(names), dtype=torch.float64), 0, 0
        if counted < num_pairs:
            keep = keep.to(policy.chosen.device)
            policy = policy.select(keep)
            reference = reference.select(keep) if reference is not None else None
        loss, metrics = self.preference_loss(policy, reference)
        loss_sum = loss * counted
        if aux is not None and self.router_aux_loss is not None:
            loss_sum = loss_sum + self.router_aux_loss.coefficient * aux * counted
        sums = torch.stack([metrics[name].double().sum() for name in names])
        return loss_sum, sums, counted, num_response_tokens(batch)  # padding repeats have none

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """The micro-batch's pairs' *summed* loss; :meth:`on_before_optimizer_step` divides the
        window's gradient by the pairs of the whole window on all ranks."""
        loss_sum, sums, pairs, answer = self.pair_losses(batch)
        self.pair_window.add(loss_sum, sums, pairs, num_tokens(batch), answer)
        return loss_sum

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the step's gradient that of the mean loss over every pair of the window, all ranks
        (before any clipping); log it and TRL's metrics under ``train/``."""
        totals = self.pair_window.close(
            lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"), self.device
        )
        trainer = self.trainer
        factor = gradient_factor(totals.pairs, trainer.accumulate_grad_batches, trainer.world_size)
        scale_gradients((p for group in optimizer.param_groups for p in group["params"]), factor)
        self.tokens_seen += totals.tokens
        self.response_tokens_seen += totals.answer_tokens
        self.log("train/loss", totals.loss, prog_bar=True, batch_size=1)
        self.log("train/pairs", float(totals.pairs), batch_size=1)
        self.log("train/tokens", float(self.tokens_seen), batch_size=1)
        self.log("train/lr", optimizer.param_groups[0]["lr"], prog_bar=True, batch_size=1)
        for name, value in totals.metrics().items():
            self.log(f"train/{name}", value, batch_size=1)

    # -- validation -----------------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self.val_sums = None

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Sums over the held-out pairs: loss, pairs and each metric."""
        loss_sum, sums, pairs, _ = self.pair_losses(batch)
        row = torch.cat([loss_sum.detach().double().reshape(1), sums.new_tensor([float(pairs)]), sums])
        self.val_sums = row if self.val_sums is None else self.val_sums + row

    def on_validation_epoch_end(self) -> None:
        """``val/loss`` (the mean over all held-out pairs, all ranks), ``val/pairs`` and the metrics."""
        names = self.pair_window.names
        sums = self.val_sums
        if sums is None:
            sums = torch.zeros(2 + len(names), dtype=torch.float64, device=self.device)
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum")
        pairs = float(sums[1])
        if not pairs:
            return
        metrics = {"val/loss": sums[0] / pairs, "val/pairs": sums[1]}
        metrics.update({f"val/{name}": sums[2 + k] / pairs for k, name in enumerate(names)})
        self.log_dict({k: v.float() for k, v in metrics.items()}, sync_dist=True)  # equal on every rank
        if not self.trainer.sanity_checking:
            self.last_val_step = self.global_step
