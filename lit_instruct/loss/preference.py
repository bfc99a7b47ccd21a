"""Preference losses (DPO, IPO, SimPO, ORPO) from the summed log-probabilities of each answer.

:func:`answer_logps` gives every sequence's summed log-probability of its labelled tokens through a
chunked lm_head path: the ``[tokens, vocab]`` logits are never materialized, one chunk's at a time
(forward, and again in backward, where each chunk is recomputed). The pair losses then take those
sums and the answers' token counts; they follow TRL 1.16's definitions (checked against its trainers
in ``tests/test_preference_loss.py``):

- ``dpo``: ``-(1-ε) log σ(β Δ) - ε log σ(-β Δ)``, ``Δ`` the chosen minus rejected log-ratio to the
  reference (summed over tokens); ``ε`` is conservative DPO's label smoothing (0: TRL's ``sigmoid``).
- ``ipo``: ``(Δ' - 1/(2β))²``, ``Δ'`` with each log-ratio averaged over its answer's tokens.
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
NEEDS_REFERENCE: frozenset[str] = frozenset({"dpo", "ipo"})
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
    """Each sequence's summed log-probability of its labelled tokens, ``(B,)`` fp32.

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
    per_token = torch.cat(pieces) if pieces else rows.new_zeros(0, dtype=torch.float32)
    sequence = torch.div(kept, labels.shape[1], rounding_mode="floor")
    sums = per_token.new_zeros(labels.shape[0])
    return sums.index_add(0, sequence, per_token)


def answer_token_counts(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many tokens each sequence's :func:`answer_logps` sums over, ``(B,)``."""
    return (labels != ignore_index).sum(dim=-1)


@dataclass(frozen=True)
class PairLogps:
    """Summed log-probabilities of the chosen and rejected answers of ``P`` pairs, and their token
    counts, all ``(P,)``."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @classmethod
    def from_batch(cls, logps: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
        """Split a ``[chosen rows; rejected rows]`` batch's ``(2P,)`` sums and counts."""
        if len(logps) % 2 or logps.shape != tokens.shape:
            raise ValueError(
                f"expected (2P,) sums and counts, got {tuple(logps.shape)}, {tuple(tokens.shape)}"
            )
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        return cls(chosen, rejected, chosen_tokens, rejected_tokens)

    def mean_chosen(self) -> torch.Tensor:
        """Per-token mean log-probability of each chosen answer."""
        return self.chosen / self.chosen_tokens.clamp(min=1)

    def mean_rejected(self) -> torch.Tensor:
        """Per-token mean log-probability of each rejected answer."""
        return self.rejected / self.rejected_tokens.clamp(min=1)

    def chosen_nll(self) -> torch.Tensor:
        """Mean NLL over all chosen answers' tokens of the batch (TRL's ``sft`` term)."""
        return -self.chosen.sum() / self.chosen_tokens.sum().clamp(min=1)


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
        label_smoothing: conservative DPO / SimPO's ``ε`` in ``[0, 0.5)``.
        gamma: SimPO's target margin γ (TRL's ``simpo_gamma``).
        rpo_alpha: weight of the chosen answers' mean NLL added to the loss (ORPO always has it
            with weight 1; this adds more).
    """

    kind: PreferenceKind = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("dpo", "ipo", "simpo", "orpo"):
            raise SettingError("kind", f"must be one of dpo, ipo, simpo, orpo; got {self.kind!r}")
        if not self.beta > 0:
            raise SettingError("beta", f"must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise SettingError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.kind not in ("dpo", "simpo"):
            raise SettingError("label_smoothing", f"applies to dpo and simpo, not kind: {self.kind}")
        if self.rpo_alpha < 0:
            raise SettingError("rpo_alpha", f"must be >= 0, got {self.rpo_alpha}")

    @property
    def needs_reference(self) -> bool:
        return self.kind in NEEDS_REFERENCE

    def __call__(
        self,
        policy: PairLogps,
        reference: PairLogps | None = None,
        chosen_nll: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss (mean over pairs, plus the NLL terms) and its per-pair metrics.

        ``chosen_nll`` overrides the NLL term (default: :meth:`PairLogps.chosen_nll`, over the
        chosen answers' tokens; TRL's ORPO takes it over the whole chosen sequence, prompt included).
        Metrics are ``(P,)`` tensors (detached), to be averaged over all pairs as TRL does.
        """
        if self.needs_reference and reference is None:
            raise ValueError(f"the {self.kind} loss needs reference log-probabilities")
        nll = policy.chosen_nll() if chosen_nll is None else chosen_nll
        if self.kind == "dpo":
            assert reference is not None
            chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
            losses = _smoothed_sigmoid(self.beta * (chosen - rejected), self.label_smoothing)
        elif self.kind == "ipo":
            assert reference is not None
            chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
            delta = chosen / policy.chosen_tokens.clamp(min=1) - rejected / policy.rejected_tokens.clamp(
                min=1
            )
            losses = (delta - 1 / (2 * self.beta)) ** 2
        elif self.kind == "simpo":
            chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
            losses = _smoothed_sigmoid(self.beta * (chosen - rejected) - self.gamma, self.label_smoothing)
        else:
            chosen, rejected = policy.mean_chosen(), policy.mean_rejected()
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            losses = -self.beta * F.logsigmoid(log_odds)
        loss = losses.mean()
        if self.kind == "orpo":
            loss = loss + nll
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
            metrics["nll_loss"] = nll.detach().expand(len(losses))
        return loss, metrics


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
            return PreferenceLoss(**settings)
        except SettingError as error:
            raise ConfigError(f"model.preference.{error.setting}", error.message) from None
