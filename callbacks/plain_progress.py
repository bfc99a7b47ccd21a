"""Progress as plain lines, for output that is no terminal (SLURM, CI, ``nohup``, a redirected file).

A progress bar redraws one line in place, which a log file cannot show (Rich's draws nothing until
the end). ``lit-instruct fit`` swaps the bar for :class:`PlainProgress` when stdout is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lit_instruct.clock import duration


class PlainProgress(L.Callback):
    """Every ``every_n_steps`` optimizer steps (and at the last), one line on rank 0:
    ``step 40/200 (20%) loss 1.2345 lr 2.0e-04 tokens/s 135 elapsed 5m02s eta 20m08s``.

    Args:
        every_n_steps: optimizer steps between lines.
        stream: where lines go (default: stdout, flushed each time).
    """

    def __init__(self, every_n_steps: int = 10, stream: TextIO | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.stream = stream
        self._started = 0.0
        self._first_step = 0
        self._last_printed = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()
        self._first_step = trainer.global_step  # a resumed run's rate counts its own steps only

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, total = trainer.global_step, trainer.max_steps
        last = total > 0 and step >= total
        if step == self._last_printed or not (step % self.every_n_steps == 0 or last) or step == 0:
            return
        self._last_printed = step
        self._print(self.line(trainer, step, total))

    def line(self, trainer: L.Trainer, step: int, total: int) -> str:
        """The progress line for ``step`` of ``total`` (``total`` < 1: unknown)."""
        elapsed = time.monotonic() - self._started
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total > 0 else f"step {step}"]
        for name, label, fmt in (
            ("train/loss", "loss", "{:.4f}"),
            ("train/lr", "lr", "{:.1e}"),
            ("train/tokens_per_s", "tokens/s", "{:.0f}"),
        ):
            if name in metrics:
                parts.append(f"{label} {fmt.format(float(metrics[name]))}")
        parts.append(f"elapsed {duration(elapsed)}")
        done = step - self._first_step
        if total > 0 and done > 0:
            parts.append(f"eta {duration(elapsed / done * (total - step))}")
        return " ".join(parts)

    @rank_zero_only
    def _print(self, line: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()
