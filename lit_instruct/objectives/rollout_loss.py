"""The loss of online RL on a batch of rollouts: GRPO's (each ``loss_type``, GSPO) and RLOO's, with the
metrics TRL logs, on the policy's chunked log-probabilities (never the ``[tokens, vocab]`` logits).

A rollout batch holds prompts with their sampled completions, right-padded: ``input_ids``,
``attention_mask``, ``labels`` (the completion tokens; ``IGNORE_INDEX`` on the prompt, padding and a
masked truncated completion), ``advantages`` ``(B,)`` and, where they were computed when the
completions were sampled, ``old_logps`` and ``reference_logps``: ``(n,)`` per completion token,
row-major (as :func:`~lit_instruct.loss.answer_logps.answer_token_logps` gives them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_instruct.batch import num_response_tokens
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import answer_token_entropies, answer_token_logps, sequence_sums
from lit_instruct.loss.grpo import (
    GRPO_LOSSES,
    GRPOLoss,
    ImportanceSampling,
    policy_terms,
    reduce_loss,
    rloo_terms,
)
from lit_instruct.loss.logits import LogitTransform
from lit_instruct.objectives.base import ObjectiveSums, Policy

TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
COUNTS = ("completion_tokens", "completions")
METRIC_NAMES = (*TOKEN_METRICS, *COUNTS)
"""The sums a rollout loss reports: TRL's metrics, each over the tokens or completions it averages
(:func:`rollout_metrics` divides)."""


@dataclass(frozen=True)
class Tempered(LogitTransform):
    """The model's logit transform, then a division by the sampling ``temperature``: the policy the
    completions were drawn from (TRL scores them so)."""

    temperature: float = 1.0

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        z = super().__call__(raw)
        return z / self.temperature if self.temperature != 1.0 else z


def tempered(transform: LogitTransform, temperature: float) -> LogitTransform:
    """``transform`` divided by ``temperature`` (itself at 1)."""
    if temperature == 1.0:
        return transform
    return Tempered(transform.scale, transform.softcap, temperature)


@dataclass(frozen=True)
class GRPOLossSettings:
    """GRPO's loss settings, named and defaulted as TRL 1.16's ``GRPOConfig``."""

    loss_type: GRPOLoss = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: ImportanceSampling = "token"
    delta: float | None = None
    use_bias_correction_kl: bool = True
    temperature: float = 1.0
    max_completion_length: int = 512

    def __post_init__(self) -> None:
        if self.loss_type not in GRPO_LOSSES:
            raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSSES)}, got {self.loss_type!r}")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo"):
            raise ValueError(
                f"importance_sampling_level: sequence (GSPO) takes loss_type: grpo, not {self.loss_type!r} "
                "(TRL refuses it too)"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class RLOOLossSettings:
    """RLOO's loss settings, named and defaulted as TRL 1.16's ``RLOOConfig`` (``beta`` is a penalty
    in the rewards: :func:`~lit_instruct.loss.grpo.rloo_rewards`)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0


def rollout_logps(
    policy: Policy, batch: Mapping[str, Any], temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The policy's log-probability of each completion token (``(n,)``, with its graph), each one's
    predicted distribution's entropy (``(n,)``, detached) and the trunk's auxiliary loss."""
    hidden, aux = policy.trunk(dict(batch))
    weight, bias = policy.output_weights()
    labels = batch["labels"][:, 1:]
    transform = tempered(policy.logit_transform, temperature)
    logps = answer_token_logps(hidden[:, :-1], weight, labels, bias=bias, transform=transform)
    if not len(logps):  # nothing scored (a rank's padding repeats): no loss, a graph all the same
        logps = logps + hidden.sum() * 0.0
    entropies = answer_token_entropies(hidden[:, :-1], weight, labels, bias=bias, transform=transform)
    return logps, entropies, aux


@torch.no_grad()
def completion_logps(policy: Policy, batch: Mapping[str, Any], temperature: float) -> torch.Tensor:
    """The model's log-probability of each completion token as it is now, ``(n,)``, no gradient."""
    hidden, _ = policy.trunk(dict(batch))
    weight, bias = policy.output_weights()
    transform = tempered(policy.logit_transform, temperature)
    return answer_token_logps(hidden[:, :-1], weight, batch["labels"][:, 1:], bias=bias, transform=transform)


def reference_logps(policy: Policy, batch: Mapping[str, Any], temperature: float) -> torch.Tensor:
    """The reference model's log-probability of each completion token, ``(n,)``."""
    with policy.reference_model():
        return completion_logps(policy, batch, temperature)


def grpo_sums(policy: Policy, batch: Mapping[str, Any], settings: GRPOLossSettings) -> ObjectiveSums:
    """A rollout batch's GRPO loss (as :func:`~lit_instruct.loss.grpo.reduce_loss` sums it for the
    window) and metric sums (:data:`METRIC_NAMES`)."""
    labels = batch["labels"][:, 1:]
    reference = batch.get("reference_logps")
    if settings.beta != 0.0 and reference is None:
        reference = reference_logps(policy, batch, settings.temperature)
    logps, entropies, aux = rollout_logps(policy, batch, settings.temperature)
    epsilon_high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    terms = policy_terms(
        logps,
        batch.get("old_logps"),
        reference,
        batch["advantages"],
        labels,
        epsilon_low=settings.epsilon,
        epsilon_high=epsilon_high,
        beta=settings.beta,
        importance_sampling=settings.importance_sampling_level,
        delta=settings.delta,
        bias_correction_kl=settings.use_bias_correction_kl,
    )
    reduced = reduce_loss(terms.per_token_loss, labels, settings.loss_type, settings.max_completion_length)
    if settings.importance_sampling_level == "sequence":  # one ratio per completion: clipped completions
        low, high = _per_completion(terms.low_clipped, labels), _per_completion(terms.high_clipped, labels)
    else:
        low, high = terms.low_clipped, terms.high_clipped
    kl = None if terms.kl is None else terms.kl.detach()
    sums = _metric_sums(kl, entropies, low, high, len(labels))
    return ObjectiveSums(reduced.loss_sum, reduced.count, sums, num_response_tokens(batch), aux)


def rloo_sums(policy: Policy, batch: Mapping[str, Any], settings: RLOOLossSettings) -> ObjectiveSums:
    """A rollout batch's RLOO loss (the mean over completions of the clipped surrogate on each one's
    summed log-probability ratio) and metric sums (:data:`METRIC_NAMES`; ``kl`` the first-order
    estimate ``old - ref`` when both are in the batch)."""
    labels = batch["labels"][:, 1:]
    logps, entropies, aux = rollout_logps(policy, batch, settings.temperature)
    old = batch.get("old_logps")
    old_sequences = None if old is None else sequence_sums(old, labels)
    epsilon_high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    advantages = batch["advantages"]
    loss, low, high = rloo_terms(
        logps, old_sequences, advantages, labels, epsilon_low=settings.epsilon, epsilon_high=epsilon_high
    )
    reference = batch.get("reference_logps")
    kl = old - reference if old is not None and reference is not None else None
    sums = _metric_sums(kl, entropies, low, high, len(labels))
    return ObjectiveSums(loss.sum(), len(labels), sums, num_response_tokens(batch), aux)


def rollout_metrics(sums: Mapping[str, float], sequence_clips: bool) -> dict[str, float]:
    """TRL's metrics from a window's sums: ``kl`` and ``entropy`` per completion token, the clip
    ratios per token (per completion where the ratio is one per completion: GSPO, RLOO)."""
    tokens = max(sums["completion_tokens"], 1.0)
    clips = max(sums["completions"], 1.0) if sequence_clips else tokens
    return {
        name: sums[name] / (clips if name.startswith("clip_ratio/") else tokens) for name in TOKEN_METRICS
    }


def _metric_sums(
    kl: torch.Tensor | None, entropies: torch.Tensor, low: torch.Tensor, high: torch.Tensor, completions: int
) -> torch.Tensor:
    """:data:`METRIC_NAMES`' sums, fp64 (``kl`` 0 without a reference)."""
    values = [
        kl.double().sum() if kl is not None else entropies.new_zeros((), dtype=torch.float64),
        entropies.double().sum(),
        low.double().sum(),
        high.double().sum(),
        (low | high).double().sum(),
    ]
    counts = torch.tensor([float(len(entropies)), float(completions)], dtype=torch.float64)
    return torch.cat([torch.stack(values), counts.to(entropies.device)])


def _per_completion(flags: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A per-token flag that is one per completion (shared by its tokens), ``(B,)``: its first
    token's; false for a completion with no scored token."""
    counts = (labels != IGNORE_INDEX).sum(dim=1)
    first = torch.cumsum(counts, 0) - counts
    out = torch.zeros(len(labels), dtype=torch.bool, device=flags.device)
    scored = counts > 0
    out[scored] = flags[first[scored]]
    return out
