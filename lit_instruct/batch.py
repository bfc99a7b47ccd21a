"""What a batch holds: its token counts (carried by lit-instruct's collators, counted for any other
batch), its kinds, and a prompts batch as rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

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


def prompt_rows(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A ``prompts`` batch's prompts (``prompt_ids``) as right-padded rows (``input_ids``,
    ``attention_mask``): what a pass over the data's inputs reads (EVA's initialisation)."""
    prompts = batch["prompt_ids"]
    width = max(map(len, prompts))
    return {
        "input_ids": torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
        "attention_mask": torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts]),
    }
