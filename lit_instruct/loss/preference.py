"""Preference losses (DPO and TRL's other DPO loss types, IPO, SimPO, ORPO) from the summed
log-probabilities of each answer (:mod:`lit_instruct.loss.answer_logps`: the chunked lm_head path,
never the ``[tokens, vocab]`` logits). They follow TRL 1.16's definitions (checked against its
trainers in ``tests/test_preference_loss.py``):

- ``dpo``: TRL's ``DPOTrainer`` with its ``loss_type`` (one, or a weighted list: ``loss_weights``),
  each a function of the chosen and rejected log-ratios to the reference (summed over tokens) in
  :data:`~lit_instruct.loss.dpo_losses.DPO_LOSSES`; ``sigmoid`` (the default) is
  ``-(1-ε) log σ(β Δ) - ε log σ(-β Δ)``, ``Δ`` the chosen minus rejected log-ratio, ``ε``
  conservative DPO's label smoothing (0: TRL's ``sigmoid``). ``ld_alpha`` (LD-DPO) weighs each
  answer's tokens past the pair's shared length (``PairLogps.from_tokens``), ``f_divergence_type``
  replaces the log-ratios by f-DPO's scores, ``reference_free`` takes a zero reference.
- ``ipo``: ``(Δ' - 1/(2β))²``, ``Δ'`` with each log-ratio averaged over its answer's tokens (the
  same as ``dpo`` with ``loss_type: ipo``).
- ``simpo``: ``-(1-ε) log σ(β Δ̄ - γ) - ε log σ(-(β Δ̄ - γ))``, ``Δ̄`` the difference of the
  per-token mean log-probabilities, no reference (TRL's ``CPOTrainer`` with ``loss_type="simpo"``).
- ``orpo``: ``NLL - β log σ(log odds(ȳ_c) - log odds(ȳ_r))`` on per-token mean log-probabilities,
  no reference; ``NLL`` the chosen answers' mean token NLL over the batch.

``rpo_alpha`` adds ``rpo_alpha * NLL`` to any of them (TRL's ``loss_type=[..., "sft"]`` with weight
``rpo_alpha``; CPO's ``cpo_alpha``). Metrics carry TRL's names and meanings per loss: rewards are
``β`` times the log-ratios (DPO, IPO) or the per-token mean log-probabilities (SimPO, ORPO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lit_instruct.errors import ConfigError, closest
from lit_instruct.loss.answer_logps import PairLogps
from lit_instruct.loss.dpo_losses import (
    DPO_LOSSES,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    LABEL_SMOOTHED,
    LogRatios,
    smoothed_sigmoid,
)

PreferenceKind = Literal["dpo", "ipo", "simpo", "orpo"]
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
NEEDS_REFERENCE: frozenset[str] = frozenset({"dpo", "ipo"})
"""The kinds with a reference model (unless ``reference_free``): TRL's ``DPOTrainer`` losses."""


class SettingError(ValueError):
    """A coefficient of :class:`PreferenceLoss` out of its range: ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting} {message}")
        self.setting, self.message = setting, message


@dataclass(frozen=True)
class PreferenceLoss:
    """Which pair loss, with its coefficients (TRL's names and defaults where it has them).

    Attributes:
        kind: ``dpo``, ``ipo`` (both need reference log-probabilities), ``simpo`` or ``orpo``.
        beta: DPO/IPO/SimPO's β (IPO's τ), ORPO's λ.
        label_smoothing: conservative DPO / SimPO's ``ε`` in ``[0, 0.5)``; robust DPO's label-flip
            rate, EXO's ``ε`` (> 0), AOT's smoothing.
        gamma: SimPO's target margin γ (TRL's ``simpo_gamma``).
        rpo_alpha: weight of the chosen answers' mean NLL added to the loss (ORPO always has it
            with weight 1; this adds more).
        loss_type: ``dpo``'s loss: a name of :data:`DPO_LOSSES`, or a list of them, summed with
            ``loss_weights`` (TRL's MPO: ``[sigmoid, bco_pair, sft]``, ``[0.8, 0.2, 1.0]``).
        loss_weights: one weight per loss type (default: 1 each).
        ld_alpha: LD-DPO's weight of each answer's tokens past its pair's shared length (``dpo``,
            ``ipo``; ``None``: plain sums). Applied where the sums are taken
            (:meth:`PairLogps.from_tokens`); here it is checked.
        f_divergence_type: f-DPO's divergence (:data:`F_DIVERGENCES`); other than ``reverse_kl``
            only with the loss types of :data:`F_DIVERGENCE_LOSSES`.
        f_alpha_divergence_coef: its ``α`` for ``alpha_divergence``.
        discopop_tau: DiscoPOP's temperature τ.
        reference_free: ``dpo``, ``ipo``: the reference's log-probabilities taken as 0 (no
            reference pass).
    """

    kind: PreferenceKind = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float = 0.0
    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Sequence[float] | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    reference_free: bool = False
    use_weighting: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.loss_type, str):
            object.__setattr__(self, "loss_type", tuple(self.loss_type))
        if self.loss_weights is not None:
            object.__setattr__(self, "loss_weights", tuple(self.loss_weights))
        if self.kind not in ("dpo", "ipo", "simpo", "orpo"):
            raise SettingError("kind", f"must be one of dpo, ipo, simpo, orpo; got {self.kind!r}")
        if not self.beta > 0:
            raise SettingError("beta", f"must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise SettingError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha < 0:
            raise SettingError("rpo_alpha", f"must be >= 0, got {self.rpo_alpha}")
        self._check_dpo_settings()
        types = self.loss_types
        if self.label_smoothing and self.kind != "simpo" and not set(types) & set(LABEL_SMOOTHED):
            if self.kind != "dpo":
                raise SettingError("label_smoothing", f"applies to dpo and simpo, not kind: {self.kind}")
            raise SettingError(
                "label_smoothing",
                f"applies to dpo's loss types {', '.join(LABEL_SMOOTHED)} (and to simpo), "
                f"not loss_type: {_listed(self.loss_type)}",
            )
        if "exo_pair" in types and not self.label_smoothing:
            raise SettingError(
                "label_smoothing", "must be > 0 with loss_type exo_pair (EXO's ε; its paper: 1e-3)"
            )

    def _check_dpo_settings(self) -> None:
        """The settings of the DPO family: refused with the kinds they do not apply to."""
        names = (self.loss_type,) if isinstance(self.loss_type, str) else self.loss_type
        if not names:
            raise SettingError("loss_type", "must name at least one loss type")
        unknown = [name for name in names if name not in DPO_LOSSES]
        if unknown:
            raise SettingError(
                "loss_type",
                f"{unknown[0]!r} is none of {', '.join(DPO_LOSSES)}{closest(unknown[0], list(DPO_LOSSES))}",
            )
        default = PreferenceLoss.__dataclass_fields__
        if self.kind != "dpo":
            for name in ("loss_type", "loss_weights", "f_divergence_type"):
                value = getattr(self, name)
                if value != default[name].default and value != ("sigmoid",):
                    raise SettingError(
                        name,
                        f"{_listed(value)} applies to kind: dpo, not kind: {self.kind}"
                        + (" (kind: dpo with loss_type: ipo is the same loss)" if self.kind == "ipo" else ""),
                    )
        if self.kind not in NEEDS_REFERENCE:
            for name, value in (
                ("ld_alpha", self.ld_alpha is not None),
                ("reference_free", self.reference_free),
            ):
                if value:
                    raise SettingError(
                        name, f"applies to dpo and ipo (losses against a reference), not kind: {self.kind}"
                    )
        if self.loss_weights is not None:
            if len(self.loss_weights) != len(names):
                raise SettingError(
                    "loss_weights",
                    f"has {len(self.loss_weights)} weights for {len(names)} loss types "
                    f"(loss_type: {_listed(names)})",
                )
            if not all(math.isfinite(w) and w >= 0 for w in self.loss_weights):
                raise SettingError("loss_weights", f"must be finite and >= 0, got {list(self.loss_weights)}")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise SettingError("ld_alpha", f"must be in [0, 1] (or unset), got {self.ld_alpha}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise SettingError(
                "f_divergence_type", f"{self.f_divergence_type!r} is none of {', '.join(F_DIVERGENCES)}"
            )
        others = [name for name in self.loss_types if name not in F_DIVERGENCE_LOSSES]
        if self.f_divergence_type != "reverse_kl" and others:
            raise SettingError(
                "f_divergence_type",
                f"{self.f_divergence_type} applies to loss types {', '.join(F_DIVERGENCE_LOSSES)}, not "
                f"loss_type: {others[0]} (TRL's rule: the others have no f-divergence form)",
            )
        if not self.discopop_tau > 0:
            raise SettingError("discopop_tau", f"must be > 0, got {self.discopop_tau}")
        if self.use_weighting and self.kind not in NEEDS_REFERENCE:
            raise SettingError(
                "use_weighting", f"applies to dpo and ipo (TRL's DPOTrainer), not kind: {self.kind}"
            )
        sorting = [name for name in self.loss_types if name in ("aot", "aot_unpaired")]
        if self.use_weighting and sorting:
            raise SettingError(
                "use_weighting",
                f"cannot weigh loss_type: {sorting[0]}: it sorts the batch's pairs, which would misalign "
                "each pair's weight (TRL refuses it too)",
            )

    @property
    def loss_types(self) -> tuple[str, ...]:
        """The DPO loss types summed (``ipo``: ``("ipo",)``; none for SimPO and ORPO)."""
        if self.kind == "ipo":
            return ("ipo",)
        if self.kind != "dpo":
            return ()
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per :attr:`loss_types`."""
        if self.kind == "dpo" and self.loss_weights is not None:
            return tuple(self.loss_weights)
        return (1.0,) * len(self.loss_types)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The per-pair metrics a call returns (TRL's names), in their order: declared here, each
        call's keys checked equal in the tests."""
        names: tuple[str, ...] = (*REWARD_METRICS, "logps/chosen", "logps/rejected")
        if self.kind == "orpo":
            names += ("log_odds_ratio", "log_odds_chosen")
        if self.kind == "orpo" or self.rpo_alpha:
            names += ("nll_loss",)
        return names

    @property
    def needs_reference(self) -> bool:
        return self.kind in NEEDS_REFERENCE and not self.reference_free

    def __call__(
        self,
        policy: PairLogps,
        reference: PairLogps | None = None,
        chosen_nll: torch.Tensor | None = None,
        pair_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss (mean over pairs, plus the NLL terms) and its per-pair metrics.

        ``pair_weights`` (``(P,)``, no gradient): WPO's weights (``use_weighting``), each loss type's
        per-pair loss multiplied by them before its mean, as TRL's ``DPOTrainer`` does.

        ``chosen_nll`` overrides the NLL term (default: :meth:`PairLogps.chosen_nll`, over the
        chosen answers' tokens; TRL's ORPO takes it over the whole chosen sequence, prompt included).
        With ``reference_free`` the reference is zero (``reference`` is not read).
        Metrics are ``(P,)`` tensors (detached), to be averaged over all pairs as TRL does.
        """
        if self.needs_reference and reference is None:
            raise ValueError(f"the {self.kind} loss needs reference log-probabilities")
        nll = policy.chosen_nll() if chosen_nll is None else chosen_nll
        if self.kind in NEEDS_REFERENCE:
            reference = policy.zeros() if self.reference_free else reference
            assert reference is not None
            chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
            divergence, alpha = F_DIVERGENCES[self.f_divergence_type], self.f_alpha_divergence_coef
            scores = divergence(chosen, alpha), divergence(rejected, alpha)
            ratios = LogRatios(chosen, rejected, *scores, policy, reference, nll)
            loss: torch.Tensor | float = 0.0
            for name, weight in zip(self.loss_types, self.weights, strict=True):
                per_pair = DPO_LOSSES[name](ratios, self)
                if pair_weights is not None:
                    per_pair = per_pair * pair_weights
                loss = loss + per_pair.mean() * weight
            assert isinstance(loss, torch.Tensor)
        elif self.kind == "simpo":
            chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
            loss = smoothed_sigmoid(self.beta * (chosen - rejected) - self.gamma, self.label_smoothing).mean()
        else:
            chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            loss = (-self.beta * F.logsigmoid(log_odds)).mean() + nll
        if self.rpo_alpha:
            loss = loss + self.rpo_alpha * nll
        metrics = reward_metrics(self.beta * chosen, self.beta * rejected)
        if self.kind in ("simpo", "orpo"):  # TRL's CPO and ORPO log the per-token means
            metrics["logps/chosen"], metrics["logps/rejected"] = chosen.detach(), rejected.detach()
        else:
            metrics["logps/chosen"], metrics["logps/rejected"] = (
                policy.chosen.detach(),
                policy.rejected.detach(),
            )
        if self.kind == "orpo":
            metrics["log_odds_ratio"] = F.logsigmoid(log_odds).detach()
            metrics["log_odds_chosen"] = log_odds.detach()
        if self.kind == "orpo" or self.rpo_alpha:
            metrics["nll_loss"] = nll.detach().expand(len(chosen))
        return loss, metrics


def _listed(value: object) -> str:
    """A setting's value as a config file writes it: ``hinge``, ``[sigmoid, sft]``."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-ln 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
"""TRL's reward metrics, in its order (:func:`reward_metrics`)."""


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's per-pair reward metrics (detached): ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies`` (chosen strictly above rejected) and ``rewards/margins``."""
    chosen, rejected = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).float(),
        "rewards/margins": chosen - rejected,
    }


def mean_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each per-pair metric averaged over the pairs (what TRL logs for one batch)."""
    return {name: float(values.float().mean()) for name, values in metrics.items()}


@dataclass
class PreferenceConfig:
    """The preference loss (TRL's names and defaults; :mod:`lit_instruct.loss.preference`)."""

    kind: PreferenceKind = "dpo"
    """``dpo`` (sigmoid), ``ipo`` (both against the reference), ``simpo`` or ``orpo`` (no reference)."""
    beta: float = 0.1
    """DPO/IPO/SimPO's β (IPO's τ), ORPO's λ."""
    label_smoothing: float = 0.0
    """Conservative DPO's / SimPO's ε, in ``[0, 0.5)``."""
    gamma: float = 0.5
    """SimPO's target margin γ."""
    rpo_alpha: float = 0.0
    """Weight of the chosen answers' mean NLL added to the loss (RPO; ORPO has it with weight 1)."""
    loss_type: list[str] | str = "sigmoid"
    """``dpo``: TRL's ``DPOTrainer`` loss type, or a list of them summed with ``loss_weights``:
    sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired,
    apo_zero, apo_down, discopop, sft, sigmoid_norm."""
    loss_weights: list[float] | None = None
    """One weight per loss type (default: 1 each); MPO: ``[0.8, 0.2, 1.0]`` on
    ``[sigmoid, bco_pair, sft]``."""
    ld_alpha: float | None = None
    """DPO, IPO: LD-DPO's weight in ``[0, 1]`` of each answer's tokens past its pair's shared length."""
    f_divergence_type: FDivergence = "reverse_kl"
    """``dpo``: f-DPO's divergence (``forward_kl``, ``js_divergence``, ``alpha_divergence``: only for
    the loss types of the score difference)."""
    f_alpha_divergence_coef: float = 0.5
    """``alpha_divergence``'s α."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature τ (``loss_type: discopop``)."""
    reference_free: bool = False
    """DPO, IPO: the reference's log-probabilities taken as 0 (no reference pass)."""
    use_weighting: bool = False
    """DPO, IPO: WPO's weighting: each pair's loss times the product of its answers' weights,
    ``exp`` of the mean over an answer's tokens of ``log p(token) - log Σ_v p(v)²`` (no gradient)."""
    precompute_reference: bool = False
    """DPO/IPO: the reference's log-probabilities of every pair computed once before the first step
    (and before validation) and carried by the batches, so that a step runs the policy alone. In
    fp32 they equal the reference pass of every step; in bf16 they carry bf16's rounding of other
    batch shapes (the first step's loss is then ln 2 within ~0.03, not to the last digit)."""

    def loss(self, group: str = "model.preference") -> PreferenceLoss:
        """The loss these settings describe (``group``: where a refusal says the settings are).

        Raises:
            ConfigError: naming the setting that cannot work (a kind, beta or smoothing out of range).
        """
        if self.precompute_reference and self.kind not in NEEDS_REFERENCE:
            raise ConfigError(
                f"{group}.precompute_reference",
                f"applies to dpo and ipo (they have a reference model), not kind: {self.kind}",
            )
        settings = {k: v for k, v in asdict(self).items() if k != "precompute_reference"}
        try:
            loss = PreferenceLoss(**settings)
        except SettingError as error:
            raise ConfigError(f"{group}.{error.setting}", error.message) from None
        if self.precompute_reference and self.reference_free:
            raise ConfigError(
                f"{group}.precompute_reference",
                "has no reference to compute with model.preference.reference_free: true",
            )
        return loss
