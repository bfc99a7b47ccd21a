"""The checkpoint a fit resumes from, read before Lightning reads it: for what decides the model's
structure (EVA's ranks), which must be built before sharding and the strict load."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning as L

METADATA_FILE = "meta.pt"
"""Where a distributed (folder) checkpoint keeps what is not weights or optimizer state (Lightning's)."""


def fit_checkpoint_path(trainer: L.Trainer) -> str | None:
    """The checkpoint the running ``trainer.fit`` restores from (its ``ckpt_path``, resolved), or ``None``.

    Lightning resolves it before ``setup`` but exposes it (``trainer.ckpt_path``) only when it reads
    it, after ``setup`` and ``configure_model``. It is then an argument of ``Trainer._run`` on the call
    stack, which is where it is read. ``None`` also when no such frame is found: the caller then does
    what a fresh fit does, and the strict load refuses a checkpoint that does not fit.
    """
    run = L.Trainer._run.__code__
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is run and frame.f_locals.get("self") is trainer:
            path = frame.f_locals.get("ckpt_path")
            return None if path is None else str(path)
        frame = frame.f_back
    return None


def checkpoint_entry(trainer: L.Trainer, path: str, key: str) -> Any:
    """``key`` of the checkpoint at ``path``, read with the trainer's checkpoint IO (``None`` if absent)."""
    io = trainer.strategy.checkpoint_io
    folder = Path(path)
    checkpoint = io.load_checkpoint(folder / METADATA_FILE if folder.is_dir() else path)
    return checkpoint.get(key)


def resumed_entry(trainer: L.Trainer, key: str) -> Any:
    """``key`` of the checkpoint the running fit resumes from (``None``: a fresh fit, or no such key)."""
    path = fit_checkpoint_path(trainer)
    return None if path is None else checkpoint_entry(trainer, path, key)
