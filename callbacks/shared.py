"""Helpers shared by the callbacks: figures and images to W&B (where runs write: lit_instruct.io)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
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
