"""The progress bar on a terminal: the epoch without Lightning's ``/-2`` on a step-bounded run, the
learning rate in scientific notation, no ``v_num``."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lit_instruct.train.progress_bar import (
    RichStepProgressBar,
    TQDMStepProgressBar,
    readable_bar,
    shown,
)
from tests.helpers import make, trainer


def test_a_rate_shows_in_scientific_notation_and_other_floats_to_four_decimals() -> None:
    assert shown("train/lr", 2e-4) == "2.0e-04"
    assert shown("train/loss", 1.234567) == "1.2346"
    assert shown("epoch", 3) == 3


def test_lightning_s_own_bars_are_replaced_with_their_settings() -> None:
    assert type(readable_bar(RichProgressBar())) is RichStepProgressBar
    configured = readable_bar(TQDMProgressBar(refresh_rate=5, leave=True))
    assert type(configured) is TQDMStepProgressBar
    assert configured.refresh_rate == 5 and configured._leave
    custom = RichStepProgressBar()
    assert readable_bar(custom) is custom


@pytest.mark.parametrize("bar_type", [RichStepProgressBar, TQDMStepProgressBar])
def test_after_a_step_bounded_fit_the_bar_reads_plainly(
    bar_type: type, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    module, data = make(tiny_model_dir, chat_file, learning_rate=2e-4, warmup_steps=0)
    bar = bar_type()
    fit = trainer(
        tmp_path, max_steps=2, enable_progress_bar=True, callbacks=[bar], logger=CSVLogger(tmp_path)
    )
    fit.fit(module, datamodule=data)
    assert fit.max_epochs == -1  # Lightning's own description would read "Epoch 0/-2"
    metrics = bar.get_metrics(fit, module)
    assert "v_num" not in metrics
    lr = float(fit.progress_bar_metrics["train/lr"])
    assert metrics["train/lr"] == f"{lr:.1e}" and lr > 1e-4
    if isinstance(bar, RichProgressBar):
        assert bar._get_train_description(0).strip() == "Epoch 0"


def test_a_plain_lightning_trainer_gets_the_readable_bar_from_the_module(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """No CLI: Lightning's default bar (Rich's where rich is installed, else tqdm's) is made readable by
    the module, its settings kept."""
    module, data = make(tiny_model_dir, chat_file)
    fit = trainer(tmp_path, max_steps=1, enable_progress_bar=True, logger=CSVLogger(tmp_path))
    default = fit.progress_bar_callback
    readable = {RichProgressBar: RichStepProgressBar, TQDMProgressBar: TQDMStepProgressBar}[type(default)]
    fit.fit(module, datamodule=data)
    bar = fit.progress_bar_callback
    assert type(bar) is readable and bar.refresh_rate == default.refresh_rate
    assert sum(isinstance(c, type(default)) for c in fit.callbacks) == 1
    assert "v_num" not in bar.get_metrics(fit, module) and "v_num" in default.get_metrics(fit, module)
