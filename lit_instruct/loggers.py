"""Weights & Biases, offline first: runs are kept locally unless the user has logged in."""

from __future__ import annotations

import netrc
import os
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger


def wandb_credentials_found() -> bool:
    """Whether W&B could log in: ``WANDB_API_KEY`` or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class AutoWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger``, offline unless credentials are configured.

    ``WANDB_MODE`` (``offline``/``online``/``disabled``), when set, decides; otherwise the run is
    online only when :func:`wandb_credentials_found`. Offline runs land in ``<save_dir>/wandb`` and
    ``wandb sync <run folder>`` uploads them later.

    Args:
        offline: force offline (``True``) or online (``False``); ``None`` decides as above.
        project: W&B project.
        save_dir: where the ``wandb`` folder goes (use the run's log directory).
        kwargs: anything else ``WandbLogger`` takes (``name``, ``tags``, ``log_model``...).
    """

    def __init__(
        self, offline: bool | None = None, project: str = "lit-instruct", save_dir: str = ".", **kwargs: Any
    ) -> None:
        if offline is None:
            mode = os.environ.get("WANDB_MODE")
            offline = mode in ("offline", "dryrun") if mode else not wandb_credentials_found()
        os.makedirs(save_dir, exist_ok=True)
        super().__init__(offline=offline, project=project, save_dir=save_dir, **kwargs)
