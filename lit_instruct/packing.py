"""Padding-free packing: a micro-batch's samples in one row, with attention kept inside each sample.

:class:`PackCollator` concatenates the samples (position ids restart at 0 for each one, the first
label of each is ignored so that no sample predicts the next one's first token) and records the
sample boundaries as ``packed_segments``. The module hands them to the decoder, whose attention is
:func:`packed_sdpa_attention`: causal SDPA run sample by sample, so no FLOP or byte is spent on
attention across samples (a block-diagonal mask would cost the square of the whole row).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_instruct.data.render import IGNORE_INDEX, Sample

ATTENTION = "lit_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_segments: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' SDPA attention, run separately (and causally) on each packed sample.

    Without ``packed_segments`` (an ordinary padded batch) it is plain SDPA attention.
    """
    if packed_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=True, **kwargs
        )[0]
        for s, e in itertools.pairwise(packed_segments)
    ]
    return torch.cat(outputs, dim=1), None  # (1, T, heads, head_dim)


def packed_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:
    """No mask for packed rows (the attention keeps to each sample); SDPA's mask otherwise."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(ATTENTION, packed_sdpa_attention)
AttentionMaskInterface.register(ATTENTION, packed_sdpa_mask)


class PackCollator:
    """Samples -> one padding-free row: ``input_ids``, ``labels``, ``position_ids`` of shape
    ``(1, total tokens)`` and ``packed_segments`` (sample boundaries ``0, n1, n1+n2, ...``)."""

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        input_ids, labels, positions, segments = [], [], [], [0]
        for sample in samples:
            input_ids += sample.input_ids
            labels += [IGNORE_INDEX, *sample.labels[1:]]  # never predicted from the previous sample
            positions += range(len(sample.input_ids))
            segments.append(len(input_ids))
        return {
            "input_ids": torch.tensor([input_ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "packed_segments": tuple(segments),
        }
