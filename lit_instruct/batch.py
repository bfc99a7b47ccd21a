"""Token counts of a batch: carried by lit-instruct's collators, counted for any other batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from lit_instruct.labels import IGNORE_INDEX


def num_tokens(batch: Mapping[str, Any]) -> int:
    """Real (non-padding) tokens of ``batch``."""
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def num_response_tokens(batch: Mapping[str, Any]) -> int:
    """Predicted labels of ``batch``: positions ``1..T-1`` whose label is not ``IGNORE_INDEX``."""
    if "num_response_tokens" in batch:
        return int(batch["num_response_tokens"])
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


BatchKind = Literal["conversations", "pairs", "unpaired", "prompts"]
"""What a batch holds, as an objective takes it: rendered conversations (SFT), ``[chosen; rejected]``
preference pairs, unpaired answers labelled desirable or not (KTO), or prompts whose answers the
policy samples (GRPO, RLOO)."""
