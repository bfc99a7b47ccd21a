"""Weights & Biases, offline first: runs are kept locally unless the user has logged in and W&B answers.

W&B never takes a run down: with credentials but no way to reach the service (a compute node without
internet), ``wandb.init`` would retry for about 90 s and then fail the run. The service is probed
first (seconds), and an unreachable one, or an ``init`` that fails anyway, gives an offline run with
a warning that says where it is and how to upload it (``wandb sync``).
"""

from __future__ import annotations

import netrc
import os
import sys
import warnings
from typing import Any
from urllib.parse import urlparse

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import WandbLogger

from lit_instruct.network import reachable


def wandb_credentials_found() -> bool:
    """Whether W&B could log in: ``WANDB_API_KEY`` or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_host() -> str:
    """The W&B server: ``WANDB_BASE_URL``, else https://api.wandb.ai."""
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


QUIET_VARIABLES = ("WANDB_QUIET", "WANDB_SILENT")
"""W&B's own say on its verbosity: when the environment sets one, it decides, not our default."""

STARTED_RUNS: list[Any] = []
"""The W&B runs an :class:`AutoWandbLogger` started in this process (a user's own run is theirs)."""


def sync_folder(run: Any) -> str:
    """The folder of a W&B run that ``wandb sync`` takes (its files' folder's parent)."""
    return str(run.dir).removesuffix("/files")


def _said_in_environment() -> bool:
    return any(os.environ.get(name) not in (None, "") for name in QUIET_VARIABLES)


class AutoWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger``, offline unless credentials are configured and W&B answers.

    ``WANDB_MODE`` (``offline``/``online``/``disabled``), when set, decides; otherwise the run is
    online only when :func:`wandb_credentials_found` and the server answers within seconds
    (:func:`lit_instruct.network.reachable`). Offline runs land in ``<save_dir>/wandb`` and
    ``wandb sync <run folder>`` uploads them later. An online ``wandb.init`` that fails (an
    unreachable server after all, a rejected key) falls back to an offline run, with a warning.

    Args:
        offline: force offline (``True``) or online (``False``); ``None`` decides as above.
        project: W&B project.
        save_dir: where the ``wandb`` folder goes (use the run's log directory).
        kwargs: anything else ``WandbLogger`` takes (``name``, ``tags``, ``log_model``...).
    """

    def __init__(
        self, offline: bool | None = None, project: str = "lit-instruct", save_dir: str = ".", **kwargs: Any
    ) -> None:
        self._fallback_reason: str | None = None
        if offline is None:
            mode = os.environ.get("WANDB_MODE")
            offline = mode in ("offline", "dryrun") if mode else not wandb_credentials_found()
            host = wandb_host()
            if not offline and not mode and not reachable(host):
                offline = True
                self._fallback_reason = f"W&B ({host}) is unreachable"
        os.makedirs(save_dir, exist_ok=True)
        if kwargs.get("settings") is None and not _said_in_environment():
            kwargs["settings"] = {"quiet": True}  # no metrics table after the fit report
        super().__init__(offline=offline, project=project, save_dir=save_dir, **kwargs)
        if self._wandb_init.get("anonymous", False) is None:  # wandb warns the setting is deprecated
            del self._wandb_init["anonymous"]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The W&B run; an online one that cannot start becomes an offline one."""
        if self._experiment is None and not self._offline:
            try:
                return super().experiment
            except Exception as error:
                detail = " ".join(str(error).split())  # one line
                self._fallback_reason = (
                    f"W&B could not start an online run ({type(error).__name__}: {detail})"
                )
                self._offline = True
                self._wandb_init["mode"] = "offline"
                self._experiment = None
        import wandb

        starting = self._experiment is None and wandb.run is None  # else Lightning reuses that run
        run = super().experiment
        if starting:
            STARTED_RUNS.append(run)
        if self._fallback_reason is not None:
            reason, self._fallback_reason = self._fallback_reason, None
            folder = sync_folder(run)
            warnings.warn(
                f"{reason}: logging offline to {folder}; upload it later with `wandb sync {folder}`",
                stacklevel=2,
            )
        return run


def finish_wandb_runs(exit_code: int | None = None) -> None:
    """Finish the W&B runs :class:`AutoWandbLogger` started, now rather than at exit (then W&B's
    service writes its closing lines with a terminal's colour codes to whatever stdout is), and say
    how to upload an offline one: ``wandb sync <its folder>``."""
    while STARTED_RUNS:
        run = STARTED_RUNS.pop()
        if getattr(run, "_is_finished", False):
            continue
        folder = sync_folder(run)
        offline = bool(getattr(run, "offline", False))
        run.finish(exit_code=exit_code)
        if offline:
            sys.stderr.write(f"lit-instruct: W&B run logged offline; upload it with `wandb sync {folder}`\n")
