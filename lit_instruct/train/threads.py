"""The thread budget of a fit (:mod:`lit_instruct.cpu_threads`): chosen when the fit sets up, so that
the validation before training, an EVA data pass, the training steps, validation and the answers
:class:`~lit_instruct.callbacks.SampleScores` generates all run on the cores other processes leave
free; looked at again every few seconds of work."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.cpu_threads import CoreShare, machine_busy_seconds, own_busy_seconds, threads_for

__all__ = ["ThreadBudget", "machine_busy_seconds", "own_busy_seconds", "threads_for"]


class ThreadBudget(L.Callback):
    """On a CPU run, from its setup (``fit`` or ``validate``) to its teardown: the cores the rest of
    the machine used, and ``torch.set_num_threads`` to those left, looked at again every ``every_s``
    seconds of training or validation batches."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.share = CoreShare(every_s, say=rank_zero_info)

    @property
    def active(self) -> bool:
        return self.share.active

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type == "cpu":
            self.share.start("training" if stage == "fit" else "validation")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.share.check()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.share.check()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.share.stop()
