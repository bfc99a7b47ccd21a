"""CPU threads chosen from the cores other processes leave free, not inherited from the machine.

PyTorch runs each CPU op on as many threads as the process may use cores, and every op waits for
its slowest thread. When another process keeps one of those cores busy (another user's job: its
``nice`` does not reach across login sessions, whose scheduler groups share the CPU equally), one
thread runs at a fraction of its core and every op waits for it: a step, a validation pass or a
generated token slows many times over, where one thread fewer runs at full speed.

:class:`CoreShare` looks at how many cores the rest of the machine used (all CPU time from
``/proc/stat`` minus this process's own) and runs on the cores left (never more threads than it
started with), back up when they free again; each change is said once. Training, validation and
generation in a fit use it through :class:`~lit_instruct.train.threads.ThreadBudget`; the commands
that compute outside a fit (``generate``, ``chat``, ``eval``, ``export --merge``) through
:func:`sharing_cores`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")
FIRST_LOOK_S = 0.1
"""How long the first look at the machine lasts, before the work starts."""
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


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CoreShare:
    """``torch.set_num_threads`` to the cores the rest of the machine leaves free: a first look when
    started, a new look at :meth:`check` every ``every_s`` seconds, the threads it found given back
    at :meth:`stop`. Does nothing where there is no ``/proc/stat``."""

    def __init__(self, every_s: float = 5.0, say: Callable[[str], None] | None = None) -> None:
        self.every_s = every_s
        self.say = say
        self.active = False

    def start(self, what: str = "training") -> None:
        """Look at the machine for :data:`FIRST_LOOK_S` (idle), then choose the threads for ``what``."""
        if self.active or machine_busy_seconds() is None:
            return
        self.active, self.what = True, what
        self.cores = usable_cores()
        self.ceiling = torch.get_num_threads()
        self._mark()
        time.sleep(FIRST_LOOK_S)  # idle: what the others use while this process does not compete
        self._choose()

    def check(self) -> None:
        """Choose again when ``every_s`` seconds passed since the last look."""
        if self.active and time.monotonic() - self.at >= self.every_s:
            self._choose()

    def stop(self) -> None:
        """Give back the threads the process had when started."""
        if self.active:
            torch.set_num_threads(self.ceiling)
            self.active = False

    def _mark(self) -> None:
        self.at, self.machine, self.own = time.monotonic(), machine_busy_seconds() or 0.0, own_busy_seconds()

    def _choose(self) -> None:
        wall = max(time.monotonic() - self.at, 1e-3)
        others = (
            max(0.0, ((machine_busy_seconds() or 0.0) - self.machine) - (own_busy_seconds() - self.own))
            / wall
        )
        wanted = threads_for(self.cores, others, self.ceiling)
        if wanted != torch.get_num_threads():
            if self.say is not None:
                self.say(
                    f"lit-instruct: other processes use {others:.1f} of {self.cores} cores: "
                    f"{self.what} on {wanted} thread{'s' * (wanted > 1)} (was {torch.get_num_threads()})"
                )
            torch.set_num_threads(wanted)
        self._mark()


@contextmanager
def sharing_cores(what: str, say: Callable[[str], None] | None = None) -> Iterator[CoreShare]:
    """A command's work on the cores others leave free (on the CPU): call ``check()`` on the yielded
    :class:`CoreShare` between units of work (an answer, a record) to follow the machine."""
    share = CoreShare(say=say)
    if not torch.cuda.is_available():
        share.start(what)
    try:
        yield share
    finally:
        share.stop()
