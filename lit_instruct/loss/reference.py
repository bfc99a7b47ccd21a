"""Masked causal-LM cross-entropy on materialized logits: the numerical ground truth.

Every loss in lit-instruct has the signature ``loss_fn(hidden, weight, labels, *, bias, transform)``
with rows already aligned (row ``p`` of ``hidden`` predicts ``labels[p]``) and equals
``F.cross_entropy(transform(hidden @ weight.T + bias), labels, ignore_index=-100, reduction=...)``.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from lit_instruct.distributed import refuse_sharded
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.logits import IDENTITY, LogitTransform

Reduction = Literal["mean", "sum"]


class LossFn(Protocol):
    """What the module calls; the reference and the fused loss both satisfy it."""

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        transform: LogitTransform = IDENTITY,
        reduction: Reduction = "mean",
    ) -> torch.Tensor: ...


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise unless every label is a vocabulary id or ``ignore_index`` (one device sync): an indexed
    read would go out of bounds, or count a negative label from the end, silently."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise ValueError(
            f"label {first} is outside the vocabulary [0, {vocab}) and is not ignore_index={ignore_index}"
        )


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
