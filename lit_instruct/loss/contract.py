"""What every loss is: ``loss_fn(hidden, weight, labels, *, bias, transform, reduction)`` with rows
already aligned (row ``p`` of ``hidden`` predicts ``labels[p]``), equal to
``F.cross_entropy(transform(hidden @ weight.T + bias), labels, ignore_index=-100, reduction=...)``.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

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
