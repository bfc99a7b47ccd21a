"""Preference losses (DPO and TRL's other DPO loss types, IPO, SimPO, ORPO) from the summed
log-probabilities of each answer.

:func:`answer_logps` gives every sequence's summed log-probability of its labelled tokens through a
chunked lm_head path: the ``[tokens, vocab]`` logits are never materialized, one chunk's at a time
(forward, and again in backward, where each chunk is recomputed). The pair losses then take those
sums and the answers' token counts; they follow TRL 1.16's definitions (checked against its trainers
in ``tests/test_preference_loss.py``):

- ``dpo``: TRL's ``DPOTrainer`` with its ``loss_type`` (one, or a weighted list: ``loss_weights``),
  each a function of the chosen and rejected log-ratios to the reference (summed over tokens) in
  :data:`DPO_LOSSES`; ``sigmoid`` (the default) is ``-(1-ε) log σ(β Δ) - ε log σ(-β Δ)``, ``Δ`` the
  chosen minus rejected log-ratio, ``ε`` conservative DPO's label smoothing (0: TRL's ``sigmoid``).
  ``ld_alpha`` (LD-DPO) weighs each answer's tokens past the pair's shared length
  (:meth:`PairLogps.from_tokens`), ``f_divergence_type`` replaces the log-ratios by f-DPO's scores,
  ``reference_free`` takes a zero reference.
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

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_instruct.distributed import refuse_sharded
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.contract import check_labels
from lit_instruct.loss.fused import default_chunk_size
from lit_instruct.loss.logits import IDENTITY, LogitTransform

PreferenceKind = Literal["dpo", "ipo", "simpo", "orpo"]
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
NEEDS_REFERENCE: frozenset[str] = frozenset({"dpo", "ipo"})
"""The kinds with a reference model (unless ``reference_free``): TRL's ``DPOTrainer`` losses."""
CHUNK_BUFFERS = 8
"""Logits-sized buffers a chunk's workspace is divided by: 320 rows for SmolLM2's 49,152-token vocab
(its DPO step's peak RSS fell by ~600 MB, 5.1 to 4.5 GB, from 1,344 rows at the same speed)."""


def _chunk_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: LogitTransform,
) -> torch.Tensor:
    """``log_softmax(transform(hidden @ weight.T + bias))[row, label]`` for one chunk, softmax in fp32."""
    raw = F.linear(hidden, weight, bias)  # (c, V), the compute dtype
    logits = transform(raw.float())
    return logits.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


def answer_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each sequence's summed log-probability of its labelled tokens, ``(B,)`` fp32: the sums of
    :func:`answer_token_logps` (arguments as there)."""
    per_token = answer_token_logps(
        hidden, weight, labels, chunk_size, bias=bias, transform=transform, ignore_index=ignore_index
    )
    return sequence_sums(per_token, labels, ignore_index=ignore_index)


def answer_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Each labelled token's log-probability, ``(n,)`` fp32, ``n`` the labelled tokens in row-major
    order (:func:`sequence_sums` sums them per sequence).

    Args:
        hidden: ``(B, T, H)`` final hidden states, already aligned: position ``t`` predicts
            ``labels[:, t]`` (shift before calling).
        weight: ``(V, H)`` lm_head weight.
        labels: ``(B, T)`` target ids, ``ignore_index`` where nothing is scored (prompt, padding).
        chunk_size: scored rows per chunk (default: an eighth of the fused loss's fp32 workspace:
            a chunk's forward and its recomputation in backward hold ~6 logits-sized buffers).
        bias: ``(V,)`` lm_head bias, if any.
        transform: the model's logit scaling / soft-capping.

    Only the scored rows are projected, a chunk at a time; with gradients on, each chunk runs under
    activation checkpointing, so backward recomputes its logits instead of keeping them. The GEMM
    runs in autocast's dtype when autocast is on, the softmax in fp32.
    """
    refuse_sharded("lm_head weight", weight)
    refuse_sharded("lm_head bias", bias)
    if hidden.dim() != 3 or weight.dim() != 2 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden (B, T, H), weight (V, H), labels (B, T); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    check_labels(labels, weight.shape[0], ignore_index)
    flat_labels = labels.reshape(-1)
    kept = (flat_labels != ignore_index).nonzero().squeeze(1)  # (n,)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)  # (n, H)
    targets = flat_labels.index_select(0, kept)
    chunk = chunk_size or default_chunk_size(weight.shape[0], buffers=CHUNK_BUFFERS)
    compute = functools.partial(_chunk_logps, transform=transform)
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    pieces = []
    for start in range(0, len(kept), chunk):
        args = (rows[start : start + chunk], weight, bias, targets[start : start + chunk])
        pieces.append(checkpoint(compute, *args, use_reentrant=False) if recompute else compute(*args))
    return torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)


def sequence_sums(
    per_token: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``(B,)`` sums of :func:`answer_token_logps`' values per sequence of ``labels``, each token
    times ``token_weights[b, t]`` (``(B, T)``) if given."""
    flat = labels.reshape(-1) != ignore_index
    kept = flat.nonzero().squeeze(1)
    if token_weights is not None:
        per_token = per_token * token_weights.reshape(-1)[kept].to(per_token.dtype)
    sequence = torch.div(kept, labels.shape[1], rounding_mode="floor")
    return per_token.new_zeros(labels.shape[0]).index_add(0, sequence, per_token)


def length_weights(labels: torch.Tensor, ld_alpha: float, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """LD-DPO's token weights of a ``[chosen rows; rejected rows]`` batch's labels, ``(2P, T)``: 1 on
    an answer's first ``min(chosen tokens, rejected tokens)`` tokens of its pair (the shared length),
    ``ld_alpha`` past them, 0 where nothing is scored (TRL's ``ld_alpha``)."""
    scored = labels != ignore_index
    position = scored.cumsum(dim=1)
    chosen, rejected = scored.sum(dim=1).chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    tail = (position > shared).float()
    return (1.0 - (1.0 - ld_alpha) * tail) * scored


def answer_token_counts(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many tokens each sequence's :func:`answer_logps` sums over, ``(B,)``."""
    return (labels != ignore_index).sum(dim=-1)


@dataclass(frozen=True)
class PairLogps:
    """Summed log-probabilities of the chosen and rejected answers of ``P`` pairs, and their token
    counts, all ``(P,)``. With LD-DPO's ``ld_alpha`` the sums weigh the tokens past the pair's
    shared length; ``chosen_plain`` then holds the chosen answers' unweighted sums (the NLL terms')."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_plain: torch.Tensor | None = None

    @classmethod
    def from_batch(
        cls, logps: torch.Tensor, tokens: torch.Tensor, plain: torch.Tensor | None = None
    ) -> PairLogps:
        """Split a ``[chosen rows; rejected rows]`` batch's ``(2P,)`` sums and counts (and ``plain``:
        the unweighted sums, when ``logps`` are weighted)."""
        if len(logps) % 2 or logps.shape != tokens.shape:
            raise ValueError(
                f"expected (2P,) sums and counts, got {tuple(logps.shape)}, {tuple(tokens.shape)}"
            )
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        chosen_plain = None if plain is None else plain.chunk(2)[0]
        return cls(chosen, rejected, chosen_tokens, rejected_tokens, chosen_plain)

    @classmethod
    def from_tokens(
        cls,
        per_token: torch.Tensor,
        labels: torch.Tensor,
        ld_alpha: float | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> PairLogps:
        """A ``[chosen rows; rejected rows]`` batch's pairs from :func:`answer_token_logps`' values
        on its ``(2P, T)`` labels: plain sums, or LD-DPO's (:func:`length_weights`) with
        ``ld_alpha``."""
        tokens = answer_token_counts(labels, ignore_index)
        plain = sequence_sums(per_token, labels, ignore_index=ignore_index)
        if ld_alpha is None:
            return cls.from_batch(plain, tokens)
        weights = length_weights(labels, ld_alpha, ignore_index)
        return cls.from_batch(sequence_sums(per_token, labels, weights, ignore_index), tokens, plain)

    def select(self, keep: torch.Tensor) -> PairLogps:
        """The pairs where ``keep`` (a ``(P,)`` mask) is true."""
        plain = None if self.chosen_plain is None else self.chosen_plain[keep]
        return PairLogps(
            self.chosen[keep],
            self.rejected[keep],
            self.chosen_tokens[keep],
            self.rejected_tokens[keep],
            plain,
        )

    def zeros(self) -> PairLogps:
        """Zero log-probabilities with these token counts: the reference of ``reference_free``."""
        return PairLogps(
            torch.zeros_like(self.chosen),
            torch.zeros_like(self.rejected),
            self.chosen_tokens,
            self.rejected_tokens,
        )

    def mean_chosen(self) -> torch.Tensor:
        """Per-token mean log-probability of each chosen answer."""
        return self.chosen / self.chosen_tokens.clamp(min=1)

    def mean_rejected(self) -> torch.Tensor:
        """Per-token mean log-probability of each rejected answer."""
        return self.rejected / self.rejected_tokens.clamp(min=1)

    def chosen_nll(self) -> torch.Tensor:
        """Mean NLL over all chosen answers' tokens of the batch (TRL's ``sft`` term), every token
        counted once (unweighted by ``ld_alpha``)."""
        chosen = self.chosen if self.chosen_plain is None else self.chosen_plain
        return -chosen.sum() / self.chosen_tokens.sum().clamp(min=1)


class SettingError(ValueError):
    """A coefficient of :class:`PreferenceLoss` out of its range: ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting} {message}")
        self.setting, self.message = setting, message


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
    return _smoothed_sigmoid(c.beta * r.delta, c.label_smoothing)


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
    return _smoothed_sigmoid(c.beta * (policy - reference), c.label_smoothing)


def _aot_unpaired(r: LogRatios, c: PreferenceLoss) -> torch.Tensor:
    delta = torch.sort(r.chosen, dim=0)[0] - torch.sort(r.rejected, dim=0)[0]
    return _smoothed_sigmoid(c.beta * delta, c.label_smoothing)


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
                "loss_type", f"{unknown[0]!r} is none of {', '.join(DPO_LOSSES)}{_closest(unknown[0])}"
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
    def needs_reference(self) -> bool:
        return self.kind in NEEDS_REFERENCE and not self.reference_free

    def __call__(
        self,
        policy: PairLogps,
        reference: PairLogps | None = None,
        chosen_nll: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss (mean over pairs, plus the NLL terms) and its per-pair metrics.

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
            score = functools.partial(
                F_DIVERGENCES[self.f_divergence_type], alpha=self.f_alpha_divergence_coef
            )
            ratios = LogRatios(chosen, rejected, score(chosen), score(rejected), policy, reference, nll)
            loss: torch.Tensor | float = 0.0
            for name, weight in zip(self.loss_types, self.weights, strict=True):
                loss = loss + DPO_LOSSES[name](ratios, self).mean() * weight
            assert isinstance(loss, torch.Tensor)
        elif self.kind == "simpo":
            chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
            loss = _smoothed_sigmoid(
                self.beta * (chosen - rejected) - self.gamma, self.label_smoothing
            ).mean()
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


def _closest(name: str) -> str:
    import difflib

    match = difflib.get_close_matches(name, list(DPO_LOSSES), n=1)
    return f" (closest: {match[0]})" if match else ""


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1-ε) log σ(x) - ε log σ(-x)``: the sigmoid loss with conservative label smoothing."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-ln 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


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
    precompute_reference: bool = False
    """DPO/IPO: the reference's log-probabilities of every pair computed once before the first step
    (and before validation) and carried by the batches, so that a step runs the policy alone. In
    fp32 they equal the reference pass of every step; in bf16 they carry bf16's rounding of other
    batch shapes (the first step's loss is then ln 2 within ~0.03, not to the last digit)."""

    def loss(self) -> PreferenceLoss:
        """The loss these settings describe.

        Raises:
            ConfigError: naming the setting that cannot work (a kind, beta or smoothing out of range).
        """
        if self.precompute_reference and self.kind not in NEEDS_REFERENCE:
            raise ConfigError(
                "model.preference.precompute_reference",
                f"applies to dpo and ipo (they have a reference model), not kind: {self.kind}",
            )
        settings = {k: v for k, v in asdict(self).items() if k != "precompute_reference"}
        try:
            loss = PreferenceLoss(**settings)
        except SettingError as error:
            raise ConfigError(f"model.preference.{error.setting}", error.message) from None
        if self.precompute_reference and self.reference_free:
            raise ConfigError(
                "model.preference.precompute_reference",
                "has no reference to compute with model.preference.reference_free: true",
            )
        return loss
