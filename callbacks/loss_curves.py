"""A PNG of the train and validation loss curves and of throughput, at the end of fit.

Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.LossCurves
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from lit_instruct.callbacks.shared import figure, log_image
from lit_instruct.io import log_dir


class LossCurves(L.Callback):
    """Collects ``train/loss`` and ``train/tokens_per_s`` at every optimizer step and ``val/loss`` at
    every validation, and at the end of fit draws them to ``loss_curves.png`` in ``output_dir``
    (default: the log directory), whatever the logger; the image also goes to W&B when W&B logs.
    The curves are kept in checkpoints, so a resumed run draws the whole history.

    Args:
        output_dir: where the PNG goes.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        self.output_dir = output_dir
        self.train: list[tuple[int, float, float]] = []  # (step, train/loss, train/tokens_per_s)
        self.val: list[tuple[int, float]] = []  # (step, val/loss)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = trainer.callback_metrics
        stepped = not self.train or self.train[-1][0] < trainer.global_step
        if stepped and "train/loss" in metrics:
            speed = float(metrics.get("train/tokens_per_s", float("nan")))
            self.train.append((trainer.global_step, float(metrics["train/loss"]), speed))

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        directory = Path(self.output_dir) if self.output_dir else log_dir(trainer)  # every rank
        if trainer.is_global_zero and (self.train or self.val):
            directory.mkdir(parents=True, exist_ok=True)
            log_image(trainer, "train/loss_curves", self.plot(directory / "loss_curves.png"))

    def plot(self, path: Path) -> Path:
        """Draw the curves collected so far to ``path``."""
        fig = figure(figsize=(8, 6.5))
        loss_axis, speed_axis = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
        if self.train:
            steps, losses, speeds = zip(*self.train, strict=True)
            loss_axis.plot(steps, losses, label="train/loss", alpha=0.8)
            speed_axis.plot(steps, speeds, color="tab:green")
        if self.val:
            steps, losses = zip(*self.val, strict=True)
            loss_axis.plot(steps, losses, "o-", label="val/loss", color="tab:red")
        loss_axis.set(ylabel="loss (token-weighted CE)", title="Loss over response tokens")
        loss_axis.legend()
        loss_axis.grid(alpha=0.3)
        speed_axis.set(xlabel="optimizer step", ylabel="tokens/s")
        speed_axis.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train = [tuple(row) for row in state_dict["train"]]
        self.val = [tuple(row) for row in state_dict["val"]]
