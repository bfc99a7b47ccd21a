"""W&B offline runs, no secret in any file a run writes, best adapters, loss curves, the summary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from peft import PeftModel, get_peft_model_state_dict
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lit_instruct.callbacks import AdapterCheckpoint
from lit_instruct.callbacks.adapter_checkpoint import SAVING_HOOKS
from lit_instruct.cli import InstructCLI
from lit_instruct.loggers import AutoWandbLogger
from lit_instruct.secrets import redact
from tests import wandb_reader
from tests.helpers import make, trainer

SECRET = "wandb-dummy-secret-0123456789abcdef0123456789"


def fit_config(tmp_path: Path, tiny_model_dir: Path, chat_file: Path) -> Path:
    runs = str(tmp_path / "runs")
    config = {
        "seed_everything": 1,
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 4,
            "val_check_interval": 2,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "default_root_dir": runs,
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": runs, "name": ""},
                },
                {"class_path": "lit_instruct.loggers.AutoWandbLogger", "init_args": {"save_dir": runs}},
            ],
            "callbacks": [
                {
                    "class_path": "lit_instruct.callbacks.AdapterCheckpoint",
                    "init_args": {"monitor": "val/loss"},
                },
                {"class_path": "lit_instruct.callbacks.LossCurves"},
            ],
        },
        "model": {"model": str(tiny_model_dir), "lora": {"r": 4, "alpha": 8}, "learning_rate": 1e-2},
        "data": {"train_files": [str(chat_file)], "val_files": [str(chat_file)], "batch_size": 2},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_offline_wandb_run_without_secrets_with_best_adapter_and_curves(
    tiny_model_dir, chat_file, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    config = fit_config(tmp_path, tiny_model_dir, chat_file)
    cli = InstructCLI(args=["fit", "--config", str(config)])
    cli.trainer.loggers[1].experiment.finish()

    runs = tmp_path / "runs"
    (run_file,) = runs.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_reader.history(run_file)
    train = [row["train/loss"] for row in rows if "train/loss" in row]
    val = [row["val/loss"] for row in rows if "val/loss" in row]
    assert len(train) == 4 and all(math.isfinite(x) for x in train)
    speeds = [row["train/tokens_per_s"] for row in rows if "train/tokens_per_s" in row]
    assert len(speeds) == 4 and all(speed > 0 for speed in speeds)  # the module's own callback
    sizes = [row for row in rows if "model/trainable_params" in row]
    assert len(sizes) == 1 and sizes[0]["model/trainable_params"] == sum(
        p.numel() for p in cli.model.parameters() if p.requires_grad
    )
    assert len(val) == 3  # before fit, and at steps 2 and 4
    assert {row["trainer/global_step"] for row in rows if "train/lr" in row} == {0, 1, 2, 3}
    logged_config = wandb_reader.config(run_file)["config"]
    assert logged_config["model"]["lora"]["r"] == 4 and logged_config["trainer"]["max_steps"] == 4

    for path in runs.rglob("*"):  # the run folder, the CSV log dir, checkpoints, adapters
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path

    best = Path(cli.trainer.checkpoint_callback.best_model_path)
    adapter = AdapterCheckpoint.adapter_dir(best)
    assert adapter.name == best.stem + "-adapter"
    checkpoints = sorted(best.parent.glob("*.ckpt"))
    assert sorted(best.parent.glob("*-adapter")) == [AdapterCheckpoint.adapter_dir(p) for p in checkpoints]
    stored = torch.load(best, weights_only=True)["state_dict"]  # the adapter weights at the best step
    expected = {k.removeprefix("model.").replace(".default.", "."): v for k, v in stored.items()}
    written = load_file(adapter / "adapter_model.safetensors")
    assert written.keys() == expected.keys()
    for name, weight in expected.items():
        assert torch.equal(written[name], weight), name
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    loaded = {k.replace(".default.", "."): v for k, v in get_peft_model_state_dict(model).items()}
    assert all(torch.equal(loaded[name], weight) for name, weight in expected.items())

    with Image.open(runs / "version_0" / "loss_curves.png") as image:
        assert image.format == "PNG"
        image.verify()
    summary = "\n".join(r.getMessage() for r in caplog.records if "fit done" in r.getMessage())
    assert "4 optimizer steps" in summary and str(adapter) in summary and "lit-instruct generate" in summary


def test_adapter_checkpoint_follows_every_hook_in_which_model_checkpoint_saves() -> None:
    """``AdapterCheckpoint`` syncs its folders after ``ModelCheckpoint``'s saving hooks: a hook
    Lightning adds or drops there fails this test before it leaves a checkpoint without an adapter."""
    hooks = [name for name in vars(Callback) if name.startswith(("on_", "setup", "teardown"))]
    overridden = {name for name in hooks if getattr(ModelCheckpoint, name) is not getattr(Callback, name)}
    assert overridden - {"setup", "on_train_start"} == SAVING_HOOKS
    assert all(name in vars(AdapterCheckpoint) for name in SAVING_HOOKS)


def test_wandb_is_offline_without_credentials_and_online_with_them(tmp_path, monkeypatch) -> None:
    import lit_instruct.loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert AutoWandbLogger(save_dir=str(tmp_path))._offline is True
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setattr(lit_instruct.loggers, "reachable", lambda url: True)
    assert AutoWandbLogger(save_dir=str(tmp_path))._offline is False
    monkeypatch.setattr(lit_instruct.loggers, "reachable", lambda url: False)
    assert AutoWandbLogger(save_dir=str(tmp_path))._offline is True  # credentials, but no W&B
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert AutoWandbLogger(save_dir=str(tmp_path))._offline is True


def test_a_key_without_a_network_gives_an_offline_run_within_seconds(
    tiny_model_dir, chat_file, tmp_path, monkeypatch
) -> None:
    """A compute node with WANDB_API_KEY set and no internet (this machine): the fit logs offline,
    says where and how to sync, and keeps its config and history, instead of ~90 s of retries and a
    crash."""
    import time

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")  # 40 characters
    module, data = make(tiny_model_dir, chat_file)
    logger = AutoWandbLogger(save_dir=str(tmp_path), project="no-network")
    start = time.monotonic()
    with pytest.warns(
        UserWarning,
        match=r"W&B \(https://api\.wandb\.ai\) is unreachable: logging offline to .*offline-run-.*wandb sync",
    ):
        logger.log_hyperparams({"lr": 0.01})
    trainer(tmp_path, logger=logger, log_every_n_steps=1, max_steps=3, limit_val_batches=0).fit(
        module, datamodule=data
    )
    logger.experiment.finish()
    assert time.monotonic() - start < 60
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_reader.settled_history(run_file, "train/loss", rows=3)
    assert [row["trainer/global_step"] for row in rows if "train/loss" in row] == [0, 1, 2]
    assert wandb_reader.config(run_file)["lr"] == 0.01


def test_redact_secret_fields_and_secret_environment_values(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    config = {
        "hub": {"api_key": "abc", "token": "xyz"},
        "notes": f"run with {SECRET}",
        "lr": 0.1,
        "r": [SECRET],
        "data": {"tokenizer": "smollm2", "new_tokens": ["<|im_end|>"]},  # names with "token", not secrets
    }
    assert redact(config) == {
        "hub": {"api_key": "<redacted>", "token": "<redacted>"},
        "notes": "run with <redacted>",
        "lr": 0.1,
        "r": ["<redacted>"],
        "data": {"tokenizer": "smollm2", "new_tokens": ["<|im_end|>"]},
    }


INIT_FAILS = """
import json, sys, warnings
import lit_instruct.loggers as loggers
loggers.reachable = lambda url: True  # the probe passes; the init itself fails
logger = loggers.AutoWandbLogger(save_dir=sys.argv[1], project="init-fails")
online = not logger._offline
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    logger.log_metrics({"x": 1.0}, step=0)
logger.experiment.finish()
print(json.dumps({"online_at_first": online, "offline": logger._offline,
                  "warnings": [str(w.message) for w in caught if "W&B" in str(w.message)]}))
"""


@pytest.mark.slow
def test_an_online_init_that_fails_falls_back_to_an_offline_run(tmp_path) -> None:
    """The server looked reachable but ``wandb.init`` fails (nothing listens): an offline run. In a
    fresh process: wandb keeps its settings per process."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"}
    env.update(WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="5")
    env.pop("WANDB_MODE", None)
    out = subprocess.run(
        [sys.executable, "-c", INIT_FAILS, str(tmp_path)], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["online_at_first"] and result["offline"]
    (warning,) = result["warnings"]
    assert warning.startswith("W&B could not start an online run (CommError: ")
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    assert warning.endswith(f"logging offline to {run_dir}; upload it later with `wandb sync {run_dir}`")
    (run_file,) = run_dir.glob("run-*.wandb")
    assert [row["x"] for row in wandb_reader.history(run_file)] == [1.0]


def test_a_run_is_quiet_unless_the_user_or_the_environment_says_otherwise(tmp_path, monkeypatch) -> None:
    """The CLI passes ``settings=None`` (jsonargparse follows ``**kwargs`` to ``wandb.init``): quiet
    then (no metrics table after the fit report); a user's own settings, or W&B's own variables in the
    environment, decide instead."""
    for name in ("WANDB_QUIET", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    assert AutoWandbLogger(save_dir=str(tmp_path), settings=None)._wandb_init["settings"] == {"quiet": True}
    own = {"quiet": False, "console": "off"}
    assert AutoWandbLogger(save_dir=str(tmp_path), settings=own)._wandb_init["settings"] is own
    monkeypatch.setenv("WANDB_QUIET", "false")
    assert AutoWandbLogger(save_dir=str(tmp_path), settings=None)._wandb_init["settings"] is None


def test_the_runs_we_started_are_finished_with_how_to_sync_them_and_a_users_own_is_left(
    tmp_path, monkeypatch, capsys
) -> None:
    import wandb

    from lit_instruct.loggers import STARTED_RUNS, finish_wandb_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    finish_wandb_runs()  # earlier tests' loggers' runs (finished by the fixture) leave the list
    ours = AutoWandbLogger(save_dir=str(tmp_path / "ours")).experiment
    assert [ours] == STARTED_RUNS
    finish_wandb_runs(2)
    assert ours._is_finished and STARTED_RUNS == []
    folder = ours.dir.removesuffix("/files")
    said = capsys.readouterr().err
    assert f"lit-instruct: W&B run logged offline; upload it with `wandb sync {folder}`" in said
    theirs = wandb.init(mode="offline", dir=str(tmp_path / "theirs"))
    with pytest.warns(UserWarning, match="already in progress"):
        assert AutoWandbLogger(save_dir=str(tmp_path / "reused")).experiment is theirs
    finish_wandb_runs()
    assert not theirs._is_finished and STARTED_RUNS == []
    theirs.finish()
