"""Helpers shared by the callbacks: figures, images to W&B, where logs and checkpoints go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger


def figure(**kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure`` that draws straight to files: no pyplot, no global backend
    switch, nothing left open (the user's own plotting keeps its backend)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def log_image(trainer: L.Trainer, key: str, path: Path) -> None:
    """Send a PNG to every W&B logger of ``trainer``."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key, [str(path)])


def log_dir(trainer: L.Trainer) -> Path:
    """The Trainer's log directory, else its root directory.

    Under DDP ``trainer.log_dir`` is broadcast from rank 0, a collective: call this on every rank,
    before any ``is_global_zero`` branch, or the run hangs.
    """
    return Path(trainer.log_dir or trainer.default_root_dir)


def checkpoint_dir(trainer: L.Trainer) -> Path:
    """The ``ModelCheckpoint`` folder, else ``<log dir>/checkpoints`` (call it on every rank)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return log_dir(trainer) / "checkpoints"
