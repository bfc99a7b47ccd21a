"""GRPO's arithmetic, exact to TRL 1.16's ``GRPOTrainer``: group-normalized advantages from rewards,
the clipped policy-gradient term per completion token (token- or sequence-level importance
sampling: GSPO), the KL to the reference, and each ``loss_type``'s reduction written as a sum over
a unit the step window can add up across micro-batches and ranks.

Token values are flat: ``(n,)`` over the completions' scored tokens in row-major order, as
:func:`~lit_instruct.loss.answer_logps.answer_token_logps` gives them; ``labels`` (``(B, T)``,
``IGNORE_INDEX`` where nothing is scored) say which completion each belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.answer_logps import answer_token_counts, sequence_sums

GRPOLoss = Literal["grpo", "dapo", "dr_grpo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSampling = Literal["token", "sequence"]
GRPO_LOSSES: tuple[str, ...] = get_args(GRPOLoss)
STD_EPSILON = 1e-4
"""Added to the rewards' standard deviation before dividing (TRL's)."""


def nan_std(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN (along ``dim``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True) if dim is not None else torch.nanmean(values)
    square = (values - mean) ** 2
    variance = torch.nanmean(square, dim=dim, keepdim=keepdim) if dim is not None else torch.nanmean(square)
    count = (~values.isnan()).sum(dim=dim, keepdim=keepdim) if dim is not None else (~values.isnan()).sum()
    return (variance * count / (count - 1)).sqrt()


def weighted_rewards(per_reward: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward, ``(N,)``: its rewards (``(N, R)``; NaN where a reward does not
    apply) times their weights, summed over those that apply; NaN where none applies."""
    total = (per_reward * weights[None, :].to(per_reward)).nansum(dim=1)
    return total.masked_fill(per_reward.isnan().all(dim=1), float("nan"))


@dataclass(frozen=True)
class Advantages:
    """Each completion's advantage (``(N,)``; 0 where no reward applies) and whether the spread it
    was scaled by is zero (``(N,)``: TRL's ``frac_reward_zero_std``)."""

    values: torch.Tensor
    zero_std: torch.Tensor


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards,
    batch_std: torch.Tensor | None = None,
) -> Advantages:
    """GRPO's advantages of ``N = groups x num_generations`` completions (each group's completions
    consecutive): the reward minus its group's mean, divided by the group's standard deviation
    (``group``), the whole batch's (``batch``: ``batch_std`` when given, the batch of every rank,
    else these rewards') or not at all (``none``); NaN rewards are left out of the means and get
    advantage 0."""
    _check_groups(rewards, num_generations)
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = (nan_std(rewards) if batch_std is None else batch_std).expand_as(rewards)
    else:
        std = nan_std(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), zero_std)


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool) -> torch.Tensor:
    """RLOO's advantages: each reward minus the mean of its group's other rewards that are not NaN
    (with ``normalize``, then standardized over the batch); 0 where the reward is NaN or no other
    reward of its group is scored."""
    _check_groups(rewards, num_generations)
    grouped = rewards.view(-1, num_generations)
    scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
    baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = rewards - baseline.reshape(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nan_std(advantages) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def _check_groups(rewards: torch.Tensor, num_generations: int) -> None:
    if num_generations < 2 or rewards.dim() != 1 or len(rewards) % num_generations:
        raise ValueError(
            f"expected (groups x num_generations,) rewards with num_generations >= 2, got "
            f"{tuple(rewards.shape)} and {num_generations}"
        )


@dataclass(frozen=True)
class PolicyTerms:
    """One micro-batch's per-token loss (``(n,)``, the KL term included) and what TRL logs of it:
    the importance ratios (per token, or per completion with sequence-level sampling), the KL per
    token (``None`` without a reference) and the clipped tokens (``(n,)`` bools)."""

    per_token_loss: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def policy_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    reference_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    labels: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    importance_sampling: ImportanceSampling = "token",
    delta: float | None = None,
    bias_correction_kl: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> PolicyTerms:
    """The clipped surrogate ``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)`` per token,
    plus ``beta`` times the KL estimate ``exp(ref - logp) - (ref - logp) - 1``.

    ``r = exp(logp - old)`` per token, or (``sequence``: GSPO) the exponent of the completion's mean
    log-ratio, shared by its tokens; ``old_logps`` ``None``: the policy's own, detached (one
    iteration per generation); ``delta`` caps ``r`` in the unclipped term (two-sided clipping);
    ``bias_correction_kl``: the KL estimate times ``r`` (TRL's default: its gradient flows through
    ``r`` too).
    """
    rows = _token_rows(labels, ignore_index)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if importance_sampling == "sequence":
        counts = answer_token_counts(labels, ignore_index).clamp(min=1)
        log_ratio = (sequence_sums(log_ratio, labels, ignore_index=ignore_index) / counts)[rows]
    ratio = torch.exp(log_ratio)
    token_advantages = advantages.to(ratio.dtype)[rows]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * token_advantages, clipped * token_advantages)
    kl = None
    if beta != 0.0:
        if reference_logps is None:
            raise ValueError("beta != 0 needs the reference model's log-probabilities")
        gap = reference_logps - logps
        kl = torch.exp(gap) - gap - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    low = (unclipped < 1 - epsilon_low) & (token_advantages < 0)  # TRL counts the capped ratio
    high = (unclipped > 1 + epsilon_high) & (token_advantages > 0)
    return PolicyTerms(per_token, kl, low.detach(), high.detach())


def rloo_terms(
    logps: torch.Tensor,
    old_sequence_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    labels: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLOO's clipped surrogate per completion, ``(B,)``, on the ratio of the completion's summed
    probabilities (``old_sequence_logps`` ``None``: the policy's own, detached), and the completions
    clipped low and high (``(B,)`` bools)."""
    sequence = sequence_sums(logps, labels, ignore_index=ignore_index)
    old = sequence.detach() if old_sequence_logps is None else old_sequence_logps
    ratio = torch.exp(sequence - old)
    advantages = advantages.to(ratio.dtype)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low.detach(), high.detach()


def rloo_rewards(
    rewards: torch.Tensor,
    old_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    labels: torch.Tensor,
    beta: float,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """RLOO's rewards less ``beta`` times each completion's summed first-order KL estimate
    ``old - ref`` (a penalty in the reward, not a term of the loss)."""
    kl = sequence_sums(old_logps - reference_logps, labels, ignore_index=ignore_index)
    return rewards - beta * kl.to(rewards.dtype)


@dataclass(frozen=True)
class Reduced:
    """A micro-batch's loss as the window adds it up: ``loss_sum`` over ``count`` units (the window's
    loss is the sum of ``loss_sum`` over its micro-batches and ranks over the sum of ``count``)."""

    loss_sum: torch.Tensor
    count: int


def reduce_loss(
    per_token_loss: torch.Tensor,
    labels: torch.Tensor,
    loss_type: GRPOLoss,
    max_completion_length: int,
    ignore_index: int = IGNORE_INDEX,
) -> Reduced:
    """Each ``loss_type``'s reduction as TRL's: ``grpo`` the mean over completions of each one's token
    mean; ``dapo`` the token mean over the window (TRL divides by the generation batch's tokens);
    ``dr_grpo`` the token sum over completions x ``max_completion_length``; ``bnpo`` each
    micro-batch's token mean, averaged over micro-batches (as TRL, whose micro-batches are equal)."""
    counts = answer_token_counts(labels, ignore_index)
    if loss_type == "grpo":
        per_completion = sequence_sums(per_token_loss, labels, ignore_index=ignore_index)
        return Reduced((per_completion / counts.clamp(min=1)).sum(), len(labels))
    if loss_type == "dapo":
        return Reduced(per_token_loss.sum(), int(counts.sum()))
    if loss_type == "dr_grpo":
        return Reduced(per_token_loss.sum(), len(labels) * max_completion_length)
    if loss_type == "bnpo":
        return Reduced(per_token_loss.sum() / counts.sum().clamp(min=1), 1)
    raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSSES)}, got {loss_type!r}")


def _token_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The completion (row of ``labels``) of each scored token, ``(n,)``, row-major."""
    kept = (labels.reshape(-1) != ignore_index).nonzero().squeeze(1)
    return torch.div(kept, labels.shape[1], rounding_mode="floor")
