"""The named losses ``model.loss`` chooses from. A new loss is one file in this package (a callable
with the :class:`~lit_instruct.loss.contract.LossFn` signature, checked against
:func:`~lit_instruct.loss.reference.reference_linear_cross_entropy`) and one row of :data:`LOSSES`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from lit_instruct.loss.contract import LossFn
from lit_instruct.loss.fused import FusedLinearCrossEntropy
from lit_instruct.loss.reference import reference_linear_cross_entropy

LossChoice = Literal["fused", "reference"]
"""The names ``model.loss`` accepts (the keys of :data:`LOSSES`, which a test holds equal)."""

LOSSES: dict[str, Callable[[], LossFn]] = {
    "fused": FusedLinearCrossEntropy,
    "reference": lambda: reference_linear_cross_entropy,
}
"""Each name and what makes its loss: ``fused`` never materializes the ``[tokens, vocab]`` logits;
``reference`` does (the numerical ground truth)."""


def resolve_loss(loss: LossChoice | Callable | None) -> LossFn:
    """The loss a module computes with: a name of :data:`LOSSES`, or any callable with the
    :class:`~lit_instruct.loss.contract.LossFn` signature (a ``class_path`` in YAML); ``None``
    (hparams of a callable loss, which checkpoints do not keep): ``fused``."""
    if loss is None:
        loss = "fused"
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"model.loss must be one of {', '.join(LOSSES)} or a callable loss, got {loss!r}"
            )
        return LOSSES[loss]()
    if not callable(loss):
        raise ValueError(f"model.loss must be one of {', '.join(LOSSES)} or a callable loss, got {loss!r}")
    return loss  # a callable with the loss signature, as documented
