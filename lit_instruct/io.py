"""Where a run writes, and writes that never leave a half-written result: a folder or a file appears
whole, or not at all, with the modes the umask allows; tensors checked finite before they are written."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def atomic_directory(target: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target``, on failure it is removed.
    ``replace=False`` (a content-addressed cache, filled by several processes or nodes at once):
    a ``target`` that another process put in place first is kept, and the staging folder dropped."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        _as_umask_allows(staging)
        if not replace:
            try:
                staging.rename(target)
            except OSError:  # already there (ENOTEMPTY / EEXIST): the same contents by its key
                if not target.is_dir():
                    raise
                shutil.rmtree(staging, ignore_errors=True)
            return
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _as_umask_allows(folder: Path) -> None:
    """Modes as a plain write would give them (0644 / 0755 under umask 022): staging folders and
    temporary files are created private (0700 / 0600), and safetensors writes 0600, so a serving
    process under another user could not read an adapter."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod((0o777 if executable else 0o666) & ~mask)


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: never a half-written page."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
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


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise if any tensor holds NaN or Inf, naming the first such tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: tensor {name!r} contains NaN or Inf; refusing to write it")


def check_archive(file: Path) -> None:
    """Raise ``ValueError`` naming ``file`` when one of its zip records fails its CRC (``torch.load``
    does not check them)."""
    if not zipfile.is_zipfile(file):
        return  # torch's legacy format: nothing to check, torch.load reads it
    with zipfile.ZipFile(file) as archive:
        try:
            bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as failure:
            raise ValueError(f"{file} is damaged: {failure}") from None
    if bad is not None:
        raise ValueError(f"{file} is damaged: its record {bad!r} fails its CRC check")
