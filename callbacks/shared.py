"""Helpers shared by the callbacks: figures, images to W&B, where logs and checkpoints go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger

from lit_instruct.io import log_dir


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


def checkpoint_dir(trainer: L.Trainer) -> Path:
    """The ``ModelCheckpoint`` folder, else ``<log dir>/checkpoints`` (call it on every rank)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return log_dir(trainer) / "checkpoints"
