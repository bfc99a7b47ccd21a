"""Masked causal-LM cross-entropy on materialized logits: the numerical ground truth.

Every loss in lit-instruct has the signature ``loss_fn(hidden, weight, labels)`` with rows already
aligned (row ``p`` of ``hidden`` predicts ``labels[p]``) and equals
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction=...)``.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from lit_instruct.data.render import IGNORE_INDEX

Reduction = Literal["mean", "sum"]


class LossFn(Protocol):
    """What the module calls; the reference and the fused loss both satisfy it."""

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        reduction: Reduction = "mean",
    ) -> torch.Tensor: ...


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, over non-ignored rows only.

    Ignored rows (prompt, padding) are dropped before the projection, so they cost no lm_head FLOPs;
    half-precision logits are upcast to fp32 before the softmax. With no counted row the result is a
    zero that is still connected to the graph (so a backward runs on every rank).

    Args:
        hidden: ``(N, H)`` final hidden states.
        weight: ``(V, H)`` lm_head weight.
        labels: ``(N,)`` target ids, ``ignore_index`` where nothing is predicted.
        reduction: ``mean`` over counted rows, or their ``sum``.
    """
    keep = labels != ignore_index  # (N,)
    if not bool(keep.any()):
        return (hidden.sum() + weight.sum()) * 0.0
    logits = hidden[keep] @ weight.T  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels[keep], reduction=reduction)
