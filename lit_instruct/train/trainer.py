"""A Lightning ``Trainer`` that also takes ``precision="auto"``: bf16 mixed precision where the
device computes bf16 natively, fp32 elsewhere (:func:`lit_instruct.precision.auto_precision`)."""

from __future__ import annotations

from typing import Any, Literal, cast

import lightning as L
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.precision import AUTO, auto_precision


class InstructTrainer(L.Trainer):
    """``lightning.Trainer`` with ``precision="auto"`` (the default): the choice and its reason are
    printed once; any other precision is Lightning's own."""

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = AUTO,
        precision: _PRECISION_INPUT | Literal["auto"] | None = "auto",
        **kwargs: Any,
    ) -> None:
        if precision == AUTO:
            choice = auto_precision(accelerator)
            rank_zero_info(f"lit-instruct: {choice.line()}")
            precision = cast(_PRECISION_INPUT, choice.precision)
        super().__init__(
            accelerator=accelerator, precision=cast(_PRECISION_INPUT | None, precision), **kwargs
        )
