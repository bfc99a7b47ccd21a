"""Masked causal-LM cross-entropy on materialized logits: the numerical ground truth every loss of
:mod:`lit_instruct.loss.contract` is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_instruct.distributed import refuse_sharded
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.contract import Reduction
from lit_instruct.loss.logits import IDENTITY, LogitTransform


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``transform(hidden @ weight.T + bias)`` against ``labels``, counted rows only.

    Ignored rows (prompt, padding) are dropped before the projection, so they cost no lm_head FLOPs;
    half-precision logits are upcast to fp32 before the transform and the softmax. With no counted
    row the result is a zero that is still connected to the graph (so a backward runs on every rank).

    Args:
        hidden: ``(N, H)`` final hidden states.
        weight: ``(V, H)`` lm_head weight.
        labels: ``(N,)`` target ids, ``ignore_index`` where nothing is predicted.
        bias: ``(V,)`` lm_head bias, if the head has one.
        transform: the model's scaling / soft-capping of the logits.
        reduction: ``mean`` over counted rows, or their ``sum``.
    """
    refuse_sharded("lm_head weight", weight)
    refuse_sharded("lm_head bias", bias)
    keep = labels != ignore_index  # (N,)
    if not bool(keep.any()):
        zero = (hidden.sum() + weight.sum()) * 0.0
        return zero + bias.sum() * 0.0 if bias is not None else zero
    logits = F.linear(hidden[keep], weight, bias)  # (n, V)
    logits = transform(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    return F.cross_entropy(logits, labels[keep], reduction=reduction)
