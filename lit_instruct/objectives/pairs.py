"""The pair objectives: DPO (any of TRL's ``DPOTrainer`` loss types), IPO, SimPO and ORPO, on
``[chosen rows; rejected rows]`` batches (:mod:`lit_instruct.loss.preference` holds the losses).

A step runs the trunk once over the batch and sums each answer's log-probability through the chunked
lm_head path (:func:`~lit_instruct.loss.answer_logps.answer_token_logps`). The reference (DPO, IPO;
none with ``reference_free``) is the module's :meth:`reference_model`: the adapter off, or the SFT
adapter training continued from; in eval mode, without gradients. With ``precompute_reference`` it
runs once per pair before training (:mod:`lit_instruct.data.reference_cache`) and steps read its
values from the batches.

Each batch returns its pairs' *summed* loss; the module divides the window's gradient by the pairs of
the whole window on all ranks, so it is the gradient of the mean over every pair of the step. The NLL
terms (ORPO, ``rpo_alpha``, ``sft``) are each batch's token mean over its chosen answers, weighted by
its pairs (equal to TRL's on one batch; over a window, a pair-weighted mean of the batches' token
means). So are the batch terms of ``aot`` and ``aot_unpaired`` (they sort the batch's pairs, as TRL
sorts a device's batch).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.batch import BatchKind, num_response_tokens
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import (
    PairLogps,
    answer_token_log_sum_squares,
    answer_token_logps,
    wpo_weights,
)
from lit_instruct.loss.preference import FDivergence, PreferenceConfig, PreferenceKind
from lit_instruct.objectives.base import Objective, ObjectiveSums, Policy, init_parameters, metric_sums

GROUP = "model.objective.init_args"
"""Where a refusal says a pair objective's settings are."""


def answer_logps_of(
    policy: Policy,
    batch: dict[str, Any],
    hidden: torch.Tensor,
    ld_alpha: float | None,
    weighting: bool = False,
) -> PairLogps:
    """Each answer's summed log-probability from the trunk's ``hidden``; with ``ld_alpha``, LD-DPO's
    weighted sums; with ``weighting``, each pair's WPO weight too (``PairLogps.pair_weights``)."""
    if "packed_segments" in batch:
        raise ValueError("preference batches are padded rows, not packed")
    labels = batch["labels"][:, 1:]  # position p predicts p + 1
    weight, bias = policy.output_weights()
    transform = policy.logit_transform
    per_token = answer_token_logps(hidden[:, :-1], weight, labels, bias=bias, transform=transform)
    logps = PairLogps.from_tokens(per_token, labels, ld_alpha)
    if not weighting:
        return logps
    rows = hidden[:, :-1].detach()
    squares = answer_token_log_sum_squares(rows, weight, labels, bias=bias, transform=transform)
    chosen, rejected = wpo_weights(per_token, squares, labels).chunk(2)
    return dataclasses.replace(logps, pair_weights=chosen * rejected)


def refuse_outside_pairs(objective: Objective, settings: Mapping[str, Any]) -> None:
    """The module settings an objective on padded answers cannot take, refused naming both."""
    name = f"model.objective: {objective.name}"
    if settings.get("packing"):
        raise ConfigError("model.packing", f"must be false with {name}: its rows are padded, not packed")
    if settings.get("neftune_noise_alpha") is not None:
        raise ConfigError("model.neftune_noise_alpha", f"applies to SFT, not {name} (no embedding noise)")


class PairObjective(Objective):
    """A preference loss on pairs (:class:`~lit_instruct.loss.preference.PreferenceConfig`'s settings);
    logs TRL's metrics: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (and ORPO's and RPO's)."""

    kind: ClassVar[PreferenceKind] = "dpo"
    batch_kind: ClassVar[BatchKind] = "pairs"
    count_name: ClassVar[str] = "pairs"

    def __init__(self, **settings: Any) -> None:
        self.preference = PreferenceConfig(kind=self.kind, **settings)
        self.preference_loss = self.preference.loss(GROUP)
        self.metric_names = tuple(self.preference_loss.metric_names)
        self.reference_key = uuid.uuid4().hex  # names this objective's precomputed reference values

    @classmethod
    def from_preference(cls, preference: PreferenceConfig | Mapping[str, Any]) -> PairObjective:
        """The objective the old ``model.preference`` settings describe (their ``kind`` picks it)."""
        config = PreferenceConfig(**preference) if isinstance(preference, Mapping) else preference
        config.loss()  # refusals name model.preference.*, as given
        chosen = PAIR_OBJECTIVES[config.kind]
        given = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "kind"}
        objective = chosen.__new__(chosen)
        PairObjective.__init__(objective, **given)
        return objective

    def settings(self) -> dict[str, Any]:
        current = asdict(self.preference)
        return {name: current[name] for name in init_parameters(type(self)) if name in current}

    @property
    def needs_reference(self) -> bool:
        return self.preference_loss.needs_reference

    def check(self, settings: Mapping[str, Any]) -> None:
        super().check(settings)
        refuse_outside_pairs(self, settings)

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        if "num_pairs" not in batch:
            raise ValueError(
                f"{self.name} takes preference pairs: batches of an InstructDataModule(batch_kind='pairs')"
            )
        loss = self.preference_loss
        reference = None
        cached = batch.get("reference_logps") if self.preference.precompute_reference else None
        if loss.needs_reference and cached is None:
            with torch.no_grad(), policy.reference_model():
                reference = answer_logps_of(policy, batch, policy.trunk(batch)[0], loss.ld_alpha)
        hidden, aux = policy.trunk(batch)
        policy_logps = answer_logps_of(policy, batch, hidden, loss.ld_alpha, loss.use_weighting)
        if cached is not None:  # precompute_reference: only for losses with a reference
            sums = cached.to(policy_logps.chosen.device, torch.float32)
            tokens = torch.cat([policy_logps.chosen_tokens, policy_logps.rejected_tokens])
            reference = PairLogps.from_batch(sums, tokens)
        num_pairs = len(policy_logps.chosen)
        keep = batch.get("pair_mask")
        if keep is None:
            keep = (batch["labels"][:num_pairs, 1:] != IGNORE_INDEX).any(dim=1)
        counted = int(batch["num_counted_pairs"]) if "num_counted_pairs" in batch else int(keep.sum())
        if counted == 0:  # only a rank's padding repeats: no loss, but a graph through the trunk
            zeros = hidden.new_zeros(len(self.metric_names), dtype=torch.float64)
            return ObjectiveSums(hidden.sum() * 0.0, 0, zeros, 0, aux)
        if counted < num_pairs:
            keep = keep.to(policy_logps.chosen.device)
            policy_logps = policy_logps.select(keep)
            reference = reference.select(keep) if reference is not None else None
        mean_loss, metrics = loss(policy_logps, reference, pair_weights=policy_logps.pair_weights)
        sums = metric_sums(metrics, self.metric_names)
        return ObjectiveSums(mean_loss * counted, counted, sums, num_response_tokens(batch), aux)

    # -- precomputed reference values ------------------------------------------------------------

    def on_fit_start(self, policy: Policy) -> None:
        self._precompute_reference(policy, ("train", "val"))

    def on_validation_start(self, policy: Policy) -> None:
        self._precompute_reference(policy, ("val",))  # ``validate`` alone: the held-out pairs

    def _precompute_reference(self, policy: Policy, splits: tuple[str, ...]) -> None:
        if not self.preference.precompute_reference:
            return
        trainer = policy.trainer
        data: Any = getattr(trainer, "datamodule", None)
        if getattr(data, "batch_kind", None) != "pairs" or not hasattr(data, "cache_reference"):
            raise ConfigError(
                f"{GROUP}.precompute_reference",
                f"needs the pairs of an InstructDataModule(batch_kind='pairs'), got {type(data).__name__}",
            )
        device, precision = policy.device, trainer.precision_plugin
        ld_alpha = self.preference_loss.ld_alpha

        def reference(batch: dict[str, Any]) -> torch.Tensor:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with torch.no_grad(), precision.forward_context(), policy.reference_model():
                logps = answer_logps_of(policy, batch, policy.trunk(batch)[0], ld_alpha)
            return torch.cat([logps.chosen, logps.rejected])

        def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
            return trainer.strategy.reduce(values.to(device), reduce_op="sum").cpu()

        start = time.perf_counter()
        computed = data.cache_reference(
            reference, self.reference_key, splits, trainer.world_size, trainer.global_rank, all_reduce_sum
        )
        if computed:
            rank_zero_info(
                f"lit-instruct: reference log-probabilities of {computed} pairs computed once, in "
                f"{time.perf_counter() - start:.1f} s"
            )


class DPO(PairObjective):
    """DPO with any of TRL's ``DPOTrainer`` loss types (one, or a weighted list: MPO), LD-DPO's
    ``ld_alpha``, f-DPO's divergences, a zero reference (``reference_free``); settings as in
    :class:`~lit_instruct.loss.preference.PreferenceConfig`."""

    name: ClassVar[str] = "dpo"
    kind: ClassVar[PreferenceKind] = "dpo"

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: list[str] | str = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        rpo_alpha: float = 0.0,
        ld_alpha: float | None = None,
        f_divergence_type: FDivergence = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: float = 0.05,
        reference_free: bool = False,
        precompute_reference: bool = False,
        use_weighting: bool = False,
    ) -> None:
        super().__init__(
            use_weighting=use_weighting,
            beta=beta,
            loss_type=loss_type,
            loss_weights=loss_weights,
            label_smoothing=label_smoothing,
            rpo_alpha=rpo_alpha,
            ld_alpha=ld_alpha,
            f_divergence_type=f_divergence_type,
            f_alpha_divergence_coef=f_alpha_divergence_coef,
            discopop_tau=discopop_tau,
            reference_free=reference_free,
            precompute_reference=precompute_reference,
        )


class IPO(PairObjective):
    """IPO: ``(Δ' - 1/(2β))²`` on per-token mean log-ratios (``beta``: its τ)."""

    name: ClassVar[str] = "ipo"
    kind: ClassVar[PreferenceKind] = "ipo"

    def __init__(
        self,
        beta: float = 0.1,
        rpo_alpha: float = 0.0,
        ld_alpha: float | None = None,
        reference_free: bool = False,
        precompute_reference: bool = False,
        use_weighting: bool = False,
    ) -> None:
        super().__init__(
            use_weighting=use_weighting,
            beta=beta,
            rpo_alpha=rpo_alpha,
            ld_alpha=ld_alpha,
            reference_free=reference_free,
            precompute_reference=precompute_reference,
        )


class SimPO(PairObjective):
    """SimPO: no reference; ``β`` times the per-token mean log-probability difference, margin ``gamma``."""

    name: ClassVar[str] = "simpo"
    kind: ClassVar[PreferenceKind] = "simpo"

    def __init__(
        self, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0, rpo_alpha: float = 0.0
    ) -> None:
        super().__init__(beta=beta, gamma=gamma, label_smoothing=label_smoothing, rpo_alpha=rpo_alpha)


class ORPO(PairObjective):
    """ORPO: the chosen answers' NLL minus ``β`` times the log-sigmoid of their log odds ratio."""

    name: ClassVar[str] = "orpo"
    kind: ClassVar[PreferenceKind] = "orpo"

    def __init__(self, beta: float = 0.1, rpo_alpha: float = 0.0) -> None:
        super().__init__(beta=beta, rpo_alpha=rpo_alpha)


PAIR_OBJECTIVES: dict[str, type[PairObjective]] = {cls.kind: cls for cls in (DPO, IPO, SimPO, ORPO)}
"""The pair objective of each ``model.preference.kind`` (the old form)."""
