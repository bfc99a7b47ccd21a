"""What a user sees first holds no line they cannot act on: no tip, deprecation, callback override or
FutureWarning, through the real command line of ``fit`` (validation before and during it) and
``generate``; and what the fit wrote reads as plain YAML and names its base as given."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOISE = re.compile(
    r"^\S+\.py:\d+: "  # a Python warning as `warnings` and Lightning print it
    r"|Tip:|deprecat|will override existing callbacks|FutureWarning|DeprecationWarning|Traceback"
    # Lightning's account of devices and precision (ours says both), its seed line, its summary table
    # (its size and FLOPs estimates), and progress bars' carriage returns in a log (issue 50)
    r"|GPU available:|TPU available:|Automatic Mixed Precision|Seed set to|Total FLOPs|Loading weights"
    r"|stepping batches"
    r"|\x1b\[",  # a terminal's escape codes (wandb's colours) in a log
    re.IGNORECASE | re.MULTILINE,
)


def run(*args: str, cwd: Path) -> str:
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "-m", "lit_instruct", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_the_noise_pattern_finds_what_it_is_for() -> None:
    noise = [
        "/x/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated",
        "The following callbacks returned in `LightningModule.configure_callbacks` will override existing "
        "callbacks passed to Trainer: FitReport",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
        "/x/transformers/modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` is deprecated",
        "GPU available: False, used: False",
        "Seed set to 42",
        "Loading weights:   0%|          | 0/20 [00:00<?, ?it/s]Loading weights: 100%|",
        "Total FLOPs: 0",
        "\x1b[34m\x1b[1mwandb\x1b[0m: Tracking run with wandb version 0.31.0",
    ]
    assert all(NOISE.search(line) for line in noise)
    assert not NOISE.search("lit-instruct: fit done in 0m14s: 2 optimizer steps\nstep 2/2 (100%) loss 3.57")


@pytest.mark.e2e
def test_a_two_step_fit_and_a_generation_print_no_line_the_user_cannot_act_on(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    fit = run(
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.model",
        str(tiny_model_dir),
        "--data.chatterbot_categories",
        "null",
        "--data.train_files",
        str(chat_file),
        "--data.val_fraction",
        "0.3",
        "--trainer.max_steps",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.val_check_interval",
        "2",
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert "fit done" in fit
    assert [m.group(0) for m in NOISE.finditer(fit)] == [], fit
    hparams = next(tmp_path.rglob("hparams.yaml")).read_text()
    assert "!!python" not in hparams and yaml.safe_load(hparams)["config"]["model"]["betas"] == [0.9, 0.999]
    adapter = next(tmp_path.rglob("adapter_config.json")).parent
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model_dir
    )
    generated = run(
        "generate", "--adapter", str(adapter), "--prompt", "Hi", "--max-new-tokens", "2", cwd=tmp_path
    )
    assert [m.group(0) for m in NOISE.finditer(generated)] == [], generated
