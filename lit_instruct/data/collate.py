"""Tokenized samples -> batches: right-padded rows, or one padding-free packed row.

Both collators also count what the module would otherwise recount from the tensors (a host sync per
micro-batch): ``num_tokens``, the real (non-padding) tokens, and ``num_response_tokens``, the labels
that are predicted (not ``IGNORE_INDEX``; a sample's first label never is, nothing precedes it).
Given a ``source`` name, they put it in every batch (``batch["source"]``: per-source validation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lit_instruct.data.render import Sample
from lit_instruct.labels import IGNORE_INDEX


def _counts(samples: Sequence[Sample], source: str | None) -> dict[str, Any]:
    counts: dict[str, Any] = {
        "num_tokens": sum(len(s.input_ids) for s in samples),
        "num_response_tokens": sum(s.num_targets for s in samples),
    }
    if source is not None:
        counts["source"] = source
    return counts


class PadCollator:
    """Right-pad ``input_ids`` with ``pad_id`` and ``labels`` with ``IGNORE_INDEX``; build the
    attention mask.

    Args:
        pad_id: id written into padded positions (never a label, so pad == eos is safe).
        pad_to_multiple_of: round the batch length up to a multiple of this (tensor-core friendly).
        source: the name every batch carries as ``source``.
        images: an :class:`~lit_instruct.data.image_batches.ImageInputs` (a vision-language model):
            each batch carries its image tensors as ``images``.
    """

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int | None = None,
        source: str | None = None,
        images: Any = None,
    ) -> None:
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.source = source
        self.images = images  # an ImageInputs: the batch's image tensors under ``images``

    def __call__(self, samples: Sequence[Sample]) -> dict[str, Any]:
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
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        if self.images is not None:
            batch["images"] = self.images(samples, input_ids)
        return {**batch, **_counts(samples, self.source)}


class PackCollator:
    """Samples -> one padding-free row: ``input_ids``, ``labels``, ``position_ids`` of shape
    ``(1, total tokens)`` and ``packed_segments`` (sample boundaries ``0, n1, n1+n2, ...``).

    Position ids restart at 0 for each sample and the first label of each is ignored, so that no
    sample predicts the next one's first token; the model's attention runs per sample
    (:mod:`lit_instruct.models.packing`).
    """

    def __init__(self, source: str | None = None) -> None:
        self.source = source

    def __call__(self, samples: Sequence[Sample]) -> dict[str, Any]:
        input_ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        segments = [0]
        for sample in samples:
            if sample.images:
                raise ValueError(
                    f"{sample.source}: a packed row cannot carry images (a vision-language model's attention "
                    "and image positions are not split per sample): set data.packing: false"
                )
            input_ids += sample.input_ids
            labels += [IGNORE_INDEX, *sample.labels[1:]]  # never predicted from the previous sample
            positions += range(len(sample.input_ids))
            segments.append(len(input_ids))
        return {
            "input_ids": torch.tensor([input_ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "packed_segments": tuple(segments),
            **_counts(samples, self.source),
        }
