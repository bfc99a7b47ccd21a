"""Where a run writes, and writes that never leave a half-written result: a folder or a file appears
whole, or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target``, on failure it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if target.exists():
            retired = target.with_name(f".{target.name}-old")
            shutil.rmtree(retired, ignore_errors=True)
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: never a half-written page."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def log_dir(trainer: Any) -> Path:
    """A Lightning Trainer's log directory, else its root directory.

    Under DDP ``trainer.log_dir`` is broadcast from rank 0, a collective: call this on every rank,
    before any ``is_global_zero`` branch, or the run hangs.
    """
    return Path(trainer.log_dir or trainer.default_root_dir)
