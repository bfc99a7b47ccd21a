"""Pad tokenized samples into a batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_instruct.data.render import IGNORE_INDEX, Sample


class PadCollator:
    """Right-pad ``input_ids`` with ``pad_id`` and ``labels`` with -100; build the attention mask.

    Args:
        pad_id: id written into padded positions (never a label, so pad == eos is safe).
        pad_to_multiple_of: round the batch length up to a multiple of this (tensor-core friendly).
    """

    def __init__(self, pad_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        length = max(len(s.input_ids) for s in samples)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(samples), length), self.pad_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(samples), length), dtype=torch.long)  # (B, T)
        for row, sample in enumerate(samples):
            n = len(sample.input_ids)
            input_ids[row, :n] = torch.tensor(sample.input_ids)
            labels[row, :n] = torch.tensor(sample.labels)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
