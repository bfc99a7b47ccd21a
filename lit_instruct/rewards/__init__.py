"""Rewards for online RL (GRPO, RLOO): any Python callable ``(prompts, completions, **columns) ->
list[float | None]``, named in YAML, several with weights; shipped ones for verifiable tasks."""

from lit_instruct.rewards.base import Reward, RewardError, resolve_rewards, score
from lit_instruct.rewards.shipped import (
    SHIPPED,
    FormatReward,
    SoftOverlongPunishment,
    exact_answer,
    extract_final_answer,
)

__all__ = [
    "SHIPPED",
    "FormatReward",
    "Reward",
    "RewardError",
    "SoftOverlongPunishment",
    "exact_answer",
    "extract_final_answer",
    "resolve_rewards",
    "score",
]
