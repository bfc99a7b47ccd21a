"""Shared by the callbacks that draw: a headless pyplot, and images to W&B."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_image(trainer: L.Trainer, key: str, path: Path) -> None:
    """Send a PNG to every W&B logger of ``trainer``."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key, [str(path)])
