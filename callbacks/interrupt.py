"""Ctrl-C stops training at the next step boundary with a checkpoint and the adapter saved.

``lit-instruct fit`` adds it by itself; in Python: ``Trainer(callbacks=[GracefulInterrupt()])``.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_instruct.callbacks.shared import checkpoint_dir


class GracefulInterrupt(L.Callback):
    """The first SIGINT (Ctrl-C) asks the run to stop; the second interrupts at once.

    After the first, training goes on to the end of the current optimizer step (all ranks agree),
    saves ``interrupted-step=N.ckpt`` in the checkpoint folder, and ends the fit normally, so the
    module writes its adapter. ``interrupted`` then holds the checkpoint path; ``lit-instruct fit``
    exits with status 130, as an interrupted program does. Resume with ``--ckpt_path``.
    """

    def __init__(self) -> None:
        self.requested = False
        self.interrupted: str | None = None
        self._previous: Any = None
        self._last_step = -1

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        rank_zero_info(
            "\nlit-instruct: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: stop now)"
        )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            rank_zero_info("lit-instruct: training; Ctrl-C stops after the current step with a checkpoint")
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._last_step = trainer.global_step != self._last_step, trainer.global_step
        if not stepped or not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        path = checkpoint_dir(trainer) / f"interrupted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)  # collective: every rank takes this branch together
        self.interrupted = str(path)
        trainer.should_stop = True
        rank_zero_info(f"lit-instruct: interrupted at step {trainer.global_step}; checkpoint: {path}")

    def _restore(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
