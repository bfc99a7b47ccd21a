"""CPU threads chosen from the cores other processes leave free, not inherited from the machine.

PyTorch runs each CPU op on as many threads as the process may use cores, and every op waits for
its slowest thread. When another process keeps one of those cores busy (another user's job: its
``nice`` does not reach across login sessions, whose scheduler groups share the CPU equally), one
thread runs at a fraction of its core and every op of the step waits for it: on 2 cores beside one
busy process a bf16 step fell from 480 to 15 tokens/s on 2 threads, and ran at 340 on 1.

:class:`ThreadBudget` measures, every few seconds of training, how many cores the rest of the machine
used (all CPU time from ``/proc/stat`` minus this process's own) and runs on the cores left (never
more threads than it started with), back up when they free again; each change is said once.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

PROC_STAT = Path("/proc/stat")
FIRST_LOOK_S = 0.1
"""How long the first look at the machine lasts, before the first step."""
HEADROOM = 0.3
"""Cores counted free when the rest of the machine leaves at least ``1 - HEADROOM`` of them."""


def machine_busy_seconds(stat: str | None = None) -> float | None:
    """CPU seconds all processes have run (``/proc/stat``'s first line without idle and iowait);
    ``None`` where there is no ``/proc/stat``."""
    try:
        text = PROC_STAT.read_text() if stat is None else stat
    except OSError:
        return None
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    times = os.times()
    return times.user + times.system


def threads_for(cores: int, others: float, ceiling: int) -> int:
    """Threads for ``cores`` of which others keep ``others`` busy: the free ones, 1 to ``ceiling``."""
    return max(1, min(ceiling, math.floor(cores - others + HEADROOM)))


class ThreadBudget(L.Callback):
    """On a CPU run, before the first step and then every ``every_s`` seconds of training: the cores
    the rest of the machine used, and ``torch.set_num_threads`` to those left (:func:`threads_for`)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.active = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.active = trainer.strategy.root_device.type == "cpu" and machine_busy_seconds() is not None
        if not self.active:
            return
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.ceiling = torch.get_num_threads()
        self._mark()
        time.sleep(FIRST_LOOK_S)  # idle: what the others use while this process does not compete
        self._choose()

    def _mark(self) -> None:
        self.at, self.machine, self.own = time.monotonic(), machine_busy_seconds() or 0.0, own_busy_seconds()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.active and time.monotonic() - self.at >= self.every_s:
            self._choose()

    def _choose(self) -> None:
        wall = time.monotonic() - self.at
        others = (
            max(0.0, ((machine_busy_seconds() or 0.0) - self.machine) - (own_busy_seconds() - self.own))
            / wall
        )
        wanted = threads_for(self.cores, others, self.ceiling)
        if wanted != torch.get_num_threads():
            rank_zero_info(
                f"lit-instruct: other processes use {others:.1f} of {self.cores} cores: "
                f"training on {wanted} thread{'s' * (wanted > 1)} (was {torch.get_num_threads()})"
            )
            torch.set_num_threads(wanted)
        self._mark()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            torch.set_num_threads(self.ceiling)
