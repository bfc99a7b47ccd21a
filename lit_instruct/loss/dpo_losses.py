"""TRL 1.16 ``DPOTrainer``'s loss types: each a function of a pair's log-ratios to the reference
(:class:`LogRatios`) and the loss's coefficients, in one name -> function table (:data:`DPO_LOSSES`);
f-DPO's scores of the log-ratios (:data:`F_DIVERGENCES`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lit_instruct.loss.answer_logps import PairLogps

if TYPE_CHECKING:
    from lit_instruct.loss.preference import PreferenceLoss


def smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1-ε) log σ(x) - ε log σ(-x)``: the sigmoid loss with conservative label smoothing."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


@dataclass(frozen=True)
class LogRatios:
    """What a DPO loss type is a function of, per pair ``(P,)``: the chosen and rejected log-ratios
    to the reference, their f-divergence scores (the log-ratios themselves for ``reverse_kl``), the
    log-probabilities they come from, and the batch's chosen-answer NLL (a scalar)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_scores: torch.Tensor
    rejected_scores: torch.Tensor
    policy: PairLogps
    reference: PairLogps
    nll: torch.Tensor

    @property
    def delta(self) -> torch.Tensor:
        """Chosen minus rejected score (TRL's ``delta_score``)."""
        return self.chosen_scores - self.rejected_scores

    @property
    def mean_delta(self) -> torch.Tensor:
        """The scores averaged over each answer's tokens, chosen minus rejected (IPO, sigmoid_norm)."""
        return self.chosen_scores / self.policy.chosen_tokens.clamp(
            min=1
        ) - self.rejected_scores / self.policy.rejected_tokens.clamp(min=1)


LossFunction = Callable[[LogRatios, "PreferenceLoss"], torch.Tensor]


def _sigmoid(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return smoothed_sigmoid(c.beta * r.delta, c.label_smoothing)


def _hinge(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return torch.relu(1 - c.beta * r.delta)


def _ipo(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return (r.mean_delta - 1 / (2 * c.beta)) ** 2


def _exo_pair(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    logits, eps = c.beta * r.delta, c.label_smoothing
    return torch.sigmoid(logits) * (F.logsigmoid(logits) - math.log1p(-eps)) + torch.sigmoid(-logits) * (
        F.logsigmoid(-logits) - math.log(eps)
    )


def _nca_pair(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    chosen, rejected = c.beta * r.chosen, c.beta * r.rejected
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _robust(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    eps, logits = c.label_smoothing, c.beta * r.delta
    return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)


def _bco_pair(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return -F.logsigmoid(c.beta * r.chosen) - F.logsigmoid(-c.beta * r.rejected)


def _sppo_hard(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return (r.chosen - 0.5 / c.beta) ** 2 + (r.rejected + 0.5 / c.beta) ** 2


def _aot(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    policy = torch.sort(r.policy.chosen - r.policy.rejected, dim=0)[0]
    reference = torch.sort(r.reference.chosen - r.reference.rejected, dim=0)[0]
    return smoothed_sigmoid(c.beta * (policy - reference), c.label_smoothing)


def _aot_unpaired(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    delta = torch.sort(r.chosen, dim=0)[0] - torch.sort(r.rejected, dim=0)[0]
    return smoothed_sigmoid(c.beta * delta, c.label_smoothing)


def _apo_zero(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return 1 - torch.sigmoid(c.beta * r.chosen) + torch.sigmoid(c.beta * r.rejected)


def _apo_down(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return torch.sigmoid(c.beta * r.chosen) + 1 - torch.sigmoid(c.beta * (r.chosen - r.rejected))


def _discopop(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    logits = c.beta * r.delta
    modulation = torch.sigmoid(logits / c.discopop_tau)
    return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation


def _sft(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return r.nll.expand(len(r.chosen))


def _sigmoid_norm(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    return -F.logsigmoid(c.beta * r.mean_delta)


DPO_LOSSES: dict[str, LossFunction] = {
    "sigmoid": _sigmoid,  # DPO: -log σ(βΔ), conservative DPO with label_smoothing ε
    "hinge": _hinge,  # SLiC: relu(1 - βΔ)
    "ipo": _ipo,  # IPO: (Δ per token - 1/(2β))²
    "exo_pair": _exo_pair,  # EXO: KL(softmax(βΔ) || [1-ε, ε]), ε = label_smoothing > 0
    "nca_pair": _nca_pair,  # NCA: -log σ(βr_c) - ½ log σ(-βr_c) - ½ log σ(-βr_r)
    "robust": _robust,  # robust DPO: unbiased under a label-flip rate ε
    "bco_pair": _bco_pair,  # BCO on pairs: -log σ(βr_c) - log σ(-βr_r) (TRL 1.16: no running mean)
    "sppo_hard": _sppo_hard,  # SPPO, hard labels: (r_c - 1/(2β))² + (r_r + 1/(2β))²
    "aot": _aot,  # AOT: sigmoid on the sorted policy and reference log-ratio gaps of the batch
    "aot_unpaired": _aot_unpaired,  # AOT unpaired: sorted chosen and rejected log-ratios
    "apo_zero": _apo_zero,  # APO-zero: 1 - σ(βr_c) + σ(βr_r)
    "apo_down": _apo_down,  # APO-down: σ(βr_c) + 1 - σ(β(r_c - r_r))
    "discopop": _discopop,  # DiscoPOP: logistic and exponential blended by σ(βΔ/τ)
    "sft": _sft,  # the chosen answers' mean token NLL
    "sigmoid_norm": _sigmoid_norm,  # -log σ(β Δ per token)
}
"""TRL 1.16 ``DPOTrainer``'s loss types, each a function of the log-ratios and the coefficients,
per pair (``r_c``, ``r_r`` the chosen and rejected log-ratios, ``Δ`` their difference)."""

LABEL_SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
"""The DPO loss types ``label_smoothing`` enters (TRL 1.16's ``sigmoid`` has none: ours is
conservative DPO, as TRL's ``CPOTrainer`` and its ``DPOTrainer`` before 1.0)."""
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
"""The loss types of the chosen-rejected score difference: the only ones with an f-divergence other
than ``reverse_kl`` (TRL's rule)."""


def _alpha_scores(logratios: torch.Tensor, alpha: float) -> torch.Tensor:
    if abs(alpha - 1.0) < 1e-6:  # the limit: log t
        return logratios
    exponent = torch.clamp(((alpha - 1.0) * logratios).float(), max=80.0)
    return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (alpha - 1.0)


F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda t, alpha: t,  # f'(u) = log u: DPO
    "forward_kl": lambda t, alpha: 1 - torch.exp(-t),  # f'(u) = 1 - 1/u
    "js_divergence": lambda t, alpha: math.log(2) + F.logsigmoid(t),  # f'(u) = log(2u / (1 + u))
    "alpha_divergence": _alpha_scores,  # f'(u) = (u^(α-1) - 1) / (α-1)
}
"""f-DPO's scores of a log-ratio ``t = log u`` (TRL's ``f_divergence_type``, ``f_alpha_divergence_coef``)."""
