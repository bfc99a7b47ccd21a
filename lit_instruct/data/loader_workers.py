"""What a data-loading worker process does when it starts."""

from __future__ import annotations

import signal


def ignore_stop_signals(worker_id: int) -> None:
    """In a data-loading worker: Ctrl-C, SIGTERM and SIGUSR1, which ``timeout`` and SLURM send to the
    whole process group, are the main process's to handle (it stops after the step and saves)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
