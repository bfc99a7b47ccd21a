"""InstructLoRAModule: LoRA fine-tuning of a causal LM with the loss on response tokens only."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torchmetrics import MeanMetric, SumMetric

from lit_instruct.export import save_adapter
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.reference import LossFn, reference_linear_cross_entropy
from lit_instruct.model import (
    AttnImplementation,
    DType,
    LoRAConfig,
    QuantizationConfig,
    attach_lora,
    load_base_model,
    parameter_bytes,
)
from lit_instruct.moe import RouterAuxLoss
from lit_instruct.output_head import output_head
from lit_instruct.packing import enable_packing
from lit_instruct.rng import gather_rng_states, restore_rng_states
from lit_instruct.summary import FitTotals, fit_summary


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Any:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class InstructLoRAModule(L.LightningModule):
    """A causal LM with LoRA adapters, trained on the response tokens of instruction data.

    ``training_step`` runs the decoder trunk to final hidden states and hands them, shifted, to
    ``self.loss_fn(hidden, lm_head.weight, labels, bias=..., transform=...)`` with the model's own
    logit scaling / soft-capping (read from its forward and checked against its logits at load); the
    full ``[tokens, vocab]`` logits are never asked for, and a strategy may swap ``loss_fn`` for a
    fused implementation. MoE models whose forward adds the router's auxiliary loss get it added too.

    Args:
        model: bundled name (``smollm2-135m-instruct``), local folder, or hub id.
        dtype: dtype of the base weights.
        lora: LoRA adapter settings.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay on adapter weights.
        betas: AdamW betas.
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of the peak.
        adapter_dir: where the PEFT adapter is written at the end of fit (default: ``<log dir>/adapter``).
        trust_remote_code: let ``transformers`` run code shipped with the model (off: it is untrusted).
        quantization: 4-bit base weights (QLoRA): ``method: nf4`` or ``fp4``, ``double_quant``,
            ``compute_dtype``; ``dtype`` is then ignored.
        gradient_checkpointing: recompute each decoder layer's activations in backward instead of
            keeping them (less memory, about a third more compute).
        compile_layers: ``torch.compile`` each decoder layer (dynamic shapes): faster steps after
            a compilation of a minute or more.
        attn_implementation: ``auto`` (what ``transformers`` picks for the family: SDPA, or eager
            where SDPA cannot do the family's attention), ``sdpa``, ``eager``, or another
            ``transformers`` implementation (packed batches need ``sdpa`` or ``eager``).
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        dtype: DType = "float32",
        lora: LoRAConfig | dict[str, Any] | None = None,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        adapter_dir: str | None = None,
        trust_remote_code: bool = False,
        quantization: QuantizationConfig | dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        compile_layers: bool = False,
        attn_implementation: AttnImplementation = "auto",
    ) -> None:
        super().__init__()
        self.lora_config = LoRAConfig(**lora) if isinstance(lora, dict) else lora or LoRAConfig()
        if isinstance(quantization, dict):
            quantization = QuantizationConfig(**quantization)
        self.quantization = quantization or QuantizationConfig()
        self.save_hyperparameters(ignore=["lora", "quantization"])
        self.hparams["lora"] = asdict(self.lora_config)  # plain data in checkpoints
        self.hparams["quantization"] = asdict(self.quantization)
        base = load_base_model(model, dtype, trust_remote_code, self.quantization, attn_implementation)
        self.logit_transform = output_head(base).transform
        self.router_aux_loss = RouterAuxLoss.of(base)
        self.model = attach_lora(base, self.lora_config)
        self.model.train()  # from_pretrained leaves the base in eval mode; LoRA dropout must be live
        if gradient_checkpointing:  # non-reentrant: works with a frozen embedding, no input-grad hooks
            self.base_model.gradient_checkpointing_enable({"use_reentrant": False})
        if compile_layers:
            for layer in self.base_model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.loss_fn: LossFn = reference_linear_cross_entropy
        self.val_loss = MeanMetric()
        self.val_tokens = SumMetric()
        self.tokens_seen = 0
        self.response_tokens_seen = 0
        self.best_val: tuple[float, int] | None = None  # (val/loss, step)
        self.last_val_step: int | None = None
        self._fit_started = 0.0
        self._step_started = 0.0
        self._batch_tokens = 0
        self._window_loss, self._window_count, self._window_tokens = torch.zeros(()), 0, 0  # this rank's
        self._rng_to_restore: list[dict[str, Any]] | None = None

    @property
    def base_model(self) -> nn.Module:
        """The wrapped ``transformers`` model (LoRA layers injected in place)."""
        return self.model.get_base_model()

    @property
    def lm_head(self) -> nn.Module:
        """The output projection whose weight the loss takes."""
        return self.base_model.get_output_embeddings()

    def enable_packing(self) -> None:
        """Run packed batches' attention sample by sample (checked once; see
        :func:`lit_instruct.packing.enable_packing`).

        Raises:
            UnsupportedModelError: for a model that cannot be trained on packed rows exactly.
        """
        enable_packing(self.base_model)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "packing", False):
            self.enable_packing()

    def trunk(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final (normed) hidden states of the decoder, ``(B, T, H)``, and the router's auxiliary
        loss (MoE models whose forward adds it; else ``None``).

        A packed batch (:class:`~lit_instruct.packing.PackCollator`) has no attention mask but
        position ids and sample boundaries; its attention then runs sample by sample.
        """
        decoder = self.base_model.get_decoder()
        extra: dict[str, Any] = {}
        if "packed_segments" in batch:
            self.enable_packing()
            extra = {"position_ids": batch["position_ids"], "packed_segments": batch["packed_segments"]}
        if self.router_aux_loss is not None:
            extra["output_router_logits"] = True
        mask = batch.get("attention_mask")
        out = decoder(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False, **extra)
        aux = None
        if self.router_aux_loss is not None:
            aux = self.router_aux_loss(out.router_logits, mask)
        return out.last_hidden_state, aux

    def hidden_states(self, batch: dict[str, Any]) -> torch.Tensor:
        """Final (normed) hidden states of the decoder trunk, ``(B, T, H)``."""
        return self.trunk(batch)[0]

    def loss_sum_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Sum of CE over response-token predictions of ``batch``, and how many there are."""
        return self._losses(batch)[:2]

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        hidden, aux = self.trunk(batch)  # (B, T, H)
        shifted = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (B*(T-1), H): row p predicts p+1
        labels = batch["labels"][:, 1:].reshape(-1)  # (B*(T-1),)
        count = int((labels != IGNORE_INDEX).sum())
        head = self.lm_head
        loss_sum = self.loss_fn(
            shifted, head.weight, labels, bias=head.bias, transform=self.logit_transform, reduction="sum"
        )
        return loss_sum, count, aux

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The micro-batch's *summed* loss; :meth:`on_before_optimizer_step` divides the window's
        gradient by the response-token count of the whole window on all ranks.

        With a router auxiliary loss, ``coefficient * aux * count`` is added: divided by the count,
        that is the model's own ``mean CE + coefficient * aux`` (token-weighted over the window).
        """
        loss_sum, count, aux = self._losses(batch)
        if aux is not None:
            self.log("train/aux_loss", aux.detach().float(), batch_size=1)
            loss_sum = loss_sum + self.router_aux_loss.coefficient * aux * count
        self._window_loss = self._window_loss + loss_sum.detach().float()
        self._window_count += count
        tokens = (
            int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        )
        self._window_tokens += tokens
        self._batch_tokens = tokens
        return loss_sum

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the step's gradient that of sum(CE) / count over the whole window, all ranks.

        Lightning divided each micro-batch's loss by ``accumulate_grad_batches`` and DDP averaged
        over ranks; undo both and divide by the all-reduced count instead, before any clipping, so
        every response token weighs the same whatever the accumulation, rank or batch it is in.
        """
        window = torch.tensor([0.0, self._window_count, self._window_tokens], device=self.device)
        window[0] = self._window_loss
        loss_sum, count, tokens = self.trainer.strategy.reduce(window, reduce_op="sum").tolist()
        self._window_loss, self._window_count, self._window_tokens = torch.zeros(()), 0, 0
        self.tokens_seen += int(tokens)
        self.response_tokens_seen += int(count)
        factor = self.trainer.accumulate_grad_batches * self.trainer.world_size / max(count, 1.0)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        self.log("train/loss", loss_sum / max(count, 1.0), prog_bar=True, batch_size=1)
        self.log("train/response_tokens", count, batch_size=1)
        self.log("train/tokens", float(self.tokens_seen), batch_size=1)
        self.log("train/lr", optimizer.param_groups[0]["lr"], prog_bar=True, batch_size=1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._step_started
        self.log("train/tokens_per_s", self._batch_tokens / max(elapsed, 1e-9), prog_bar=True, batch_size=1)

    def on_validation_epoch_start(self) -> None:
        # Reset here, under the loop's own grad mode: states made under inference mode (a
        # `trainer.validate` before fit) cannot be updated in place by fit's validation.
        self.val_loss.reset()
        self.val_tokens.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, count = self.loss_sum_and_count(batch)
        if count:
            self.val_loss.update(loss_sum / count, weight=count)
            self.val_tokens.update(count)

    def on_validation_epoch_end(self) -> None:
        if self.val_tokens.update_count == 0:
            return
        loss = self.val_loss.compute()
        metrics = {"val/loss": loss, "val/ppl": loss.exp(), "val/tokens": self.val_tokens.compute()}
        self.log_dict(metrics, sync_dist=True)  # equal on every rank already (torchmetrics syncs)
        if not self.trainer.sanity_checking:
            self.last_val_step = self.global_step
            if self.trainer.state.fn == TrainerFn.FITTING and (
                self.best_val is None or loss < self.best_val[0]
            ):
                self.best_val = (float(loss), self.global_step)

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=self.hparams.learning_rate,
            betas=self.hparams.betas,
            weight_decay=self.hparams.weight_decay,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = warmup_cosine(self.hparams.warmup_steps, total, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _trainable_names(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter weights: what a checkpoint stores."""
        names = self._trainable_names()
        return {k: v for k, v in self.state_dict().items() if k in names}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only the trainable (adapter) weights, the frozen base is reloaded from ``model``; add
        every rank's RNG states (LoRA dropout), so that a resumed run draws the same masks."""
        checkpoint["state_dict"] = self.trainable_state_dict()
        checkpoint["tokens_seen"] = (self.tokens_seen, self.response_tokens_seen)
        if self.trainer.state.fn == TrainerFn.FITTING:
            checkpoint["rng_states"] = gather_rng_states()  # collective: every rank dumps checkpoints

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Complete the stored adapter weights with the frozen base already loaded, so that loading
        stays strict: a checkpoint that lacks an adapter weight is still an error."""
        trainable = self._trainable_names()
        base = {k: v for k, v in self.state_dict().items() if k not in trainable}
        checkpoint["state_dict"] = {**base, **checkpoint["state_dict"]}
        self.tokens_seen, self.response_tokens_seen = checkpoint.get("tokens_seen", (0, 0))
        self._rng_to_restore = checkpoint.get("rng_states")

    def on_train_start(self) -> None:
        """Put back the checkpoint's RNG states right before the first resumed step."""
        states, self._rng_to_restore = self._rng_to_restore, None
        if states is None:
            return
        if len(states) != self.trainer.world_size:
            rank_zero_warn(
                f"the checkpoint has RNG states of {len(states)} ranks, not {self.trainer.world_size}"
            )
            return
        restore_rng_states(states[self.global_rank])

    def on_fit_start(self) -> None:
        self._fit_started = time.perf_counter()
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        base = parameter_bytes(self.model)
        rank_zero_info(
            f"lit-instruct: {trainable:,} trainable of {total:,} parameters ({trainable / total:.2%}); "
            f"base weights {base['total'] / 1e6:.1f} MB "
            f"(4-bit linear layers {base['quantized_linear'] / 1e6:.1f} MB)"
        )
        metrics = {
            "model/trainable_params": float(trainable),
            "model/base_bytes": float(base["total"]),
            "model/quantized_linear_bytes": float(base["quantized_linear"]),
        }
        for logger in self.loggers:
            logger.log_metrics(metrics, step=0)

    def adapter_path(self) -> Path:
        """Where the adapter is written: ``adapter_dir``, else ``<log dir>/adapter``."""
        if self.hparams.adapter_dir:
            return Path(self.hparams.adapter_dir)
        trainer = self.trainer
        return Path(trainer.log_dir or trainer.default_root_dir) / "adapter"

    def on_fit_end(self) -> None:
        path = self.adapter_path()  # on every rank: the log directory is broadcast from rank 0
        if self.trainer.is_global_zero:
            path = save_adapter(self.model, path)
            best_loss, best_step = self.best_val or (None, None)
            seconds = time.perf_counter() - self._fit_started
            totals = FitTotals(seconds, self.tokens_seen, self.response_tokens_seen, best_loss, best_step)
            rank_zero_info(fit_summary(self.trainer, totals, path))
