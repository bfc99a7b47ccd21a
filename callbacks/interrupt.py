"""Ctrl-C, SIGTERM and SIGUSR1 stop training at the next step boundary with a checkpoint and the
adapter saved.

``lit-instruct fit`` adds it by itself; in Python: ``Trainer(callbacks=[GracefulInterrupt()])``.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_instruct.io import checkpoint_dir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""Ctrl-C; what SLURM preemption, Kubernetes, ``docker stop`` and ``timeout`` send; what SLURM's
``--signal=USR1@SECONDS`` sends ahead of the time limit."""

_forced: list[int] = []
"""The signal that stopped a run at once (a second one), for :func:`forced_exit_status`."""


def forced_exit_status() -> int | None:
    """``128 + signal`` when a second signal stopped the run at once (Lightning then exits 1)."""
    return 128 + _forced[-1] if _forced else None


class GracefulInterrupt(L.Callback):
    """The first SIGINT (Ctrl-C), SIGTERM or SIGUSR1 asks the run to stop; a second one stops it at once.

    After the first, training goes on to the end of the current optimizer step (all ranks agree, so
    a signal to one rank stops them all), saves ``interrupted-step=N.ckpt`` in the checkpoint folder,
    and ends the fit normally, so the module writes its adapter. ``interrupted`` then holds the
    checkpoint path and ``signal_number`` the signal; ``lit-instruct fit`` exits with ``128 + signal``
    (130, 143, 138) as a program stopped by it does, so that restart wrappers see no success. Resume
    with ``--ckpt_path last``. Where Lightning's SLURM plugin requeues the job (``auto_requeue``), its
    requeue signal is left to it.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_number: int | None = None
        self.interrupted: str | None = None
        self._previous: dict[int, Any] = {}
        self._last_step = -1
        self._trainer: L.Trainer | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second: stop now
            _forced.append(signum)
            self._restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # Lightning stops the other ranks, then exits (main: 130)
            launcher = getattr(getattr(self._trainer, "strategy", None), "launcher", None)
            if launcher is not None:  # the ranks this process started die with it, not hang
                launcher.kill(signal.SIGKILL)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # killed by the signal, as its sender expects
            return
        self.requested, self.signal_number = True, signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        rank_zero_info(
            f"\nlit-instruct: {name}: stopping after this step with a checkpoint ({name} again: stop now)"
        )

    @staticmethod
    def _signals() -> list[int]:
        """The stop signals to handle: SIGINT and SIGTERM always (Lightning's SIGTERM handler exits
        0); SIGUSR1 where no handler holds it, which Lightning's SLURM plugin installs to requeue the
        job (``auto_requeue``, any strategy) and a user may have installed."""
        held = signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None)
        return [s for s in STOP_SIGNALS if not (s == signal.SIGUSR1 and held)]

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        _forced.clear()
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals():  # over Lightning's SIGTERM handler, which exits 0
                self._previous[signum] = signal.signal(signum, self._on_signal)
            rank_zero_info("lit-instruct: training; Ctrl-C stops after the current step with a checkpoint")
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._last_step = trainer.global_step != self._last_step, trainer.global_step
        if not stepped or not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        # the signal, wherever it was received (on the ranks' device: NCCL reduces no CPU tensor)
        received = torch.tensor(float(self.signal_number or 0), device=trainer.strategy.root_device)
        self.signal_number = int(trainer.strategy.reduce(received, reduce_op="max"))
        path = checkpoint_dir(trainer) / f"interrupted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)  # collective: every rank takes this branch together
        self.interrupted = str(path)
        trainer.should_stop = True
        rank_zero_info(f"lit-instruct: interrupted at step {trainer.global_step}; checkpoint: {path}")

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
