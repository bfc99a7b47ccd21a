"""Ctrl-C, SIGTERM (SLURM preemption, Kubernetes, ``timeout``, ``docker stop``) and SIGUSR1 (SLURM's
``--signal``) stop a fit after the current step with a checkpoint and the adapter saved, and exit
with ``128 + signal``, never 0 (issue 49 item 5); a second signal stops at once, with the same status
(item 13). Real processes, real signals, on one process and under DDP."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lit_instruct.train.checkpoint_io import SafeCheckpointIO

READY = "Ctrl-C stops after the current step"
"""What fit says once the handlers are installed, right before step 1."""


def start_fit(tmp_path: Path, tiny_model_dir: Path, chat_file: Path, **trainer: object) -> subprocess.Popen:
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 100_000,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": False,
            **trainer,
        },
        "model": {
            "model": str(tiny_model_dir),
            "lora": {"r": 4, "alpha": 8},
            "adapter_dir": str(tmp_path / "adapter"),
        },
        "data": {"train_files": [str(chat_file)], "batch_size": 2},
        "validate_before_fit": False,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "lit_instruct", "fit", "--config", str(tmp_path / "c.yaml")]
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def wait_for(process: subprocess.Popen, text: str) -> None:
    assert process.stderr is not None
    for line in process.stderr:
        if text in line:
            return
    raise AssertionError(f"the fit ended (status {process.wait()}) without saying {text!r}")


def assert_saved_as_interrupted(tmp_path: Path, tiny_model_dir: Path, said: str) -> None:
    """One loadable ``interrupted-step=N.ckpt``, and the adapter holding its weights."""
    (checkpoint,) = (tmp_path / "runs" / "checkpoints").glob("interrupted-step=*.ckpt")
    state = SafeCheckpointIO().load_checkpoint(checkpoint)
    assert state["global_step"] > 0 and f"interrupted at step {state['global_step']}" in said
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter"
    )
    for name, value in state["state_dict"].items():
        key = name.removeprefix("model.").replace(".default.weight", ".weight")
        assert torch.equal(adapter.state_dict()[key.replace(".weight", ".default.weight")], value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 138)]
)
def test_item5_a_stop_signal_saves_a_checkpoint_and_the_adapter_and_exits_128_plus_it(
    signum: int, status: int, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    process = start_fit(tmp_path, tiny_model_dir, chat_file)
    wait_for(process, READY)
    process.send_signal(signum)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == status, rest[-3000:]
    assert_saved_as_interrupted(tmp_path, tiny_model_dir, rest)


@pytest.mark.slow
def test_item5_sigterm_to_rank_zero_stops_both_ddp_ranks_with_a_checkpoint(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    process = start_fit(tmp_path, tiny_model_dir, chat_file, devices=2, strategy="ddp_lora")
    wait_for(process, READY)
    process.send_signal(signal.SIGTERM)  # the launching process only: rank 1 learns it at the step's end
    _, rest = process.communicate(timeout=180)
    assert process.returncode == 143, rest[-3000:]
    assert_saved_as_interrupted(tmp_path, tiny_model_dir, rest)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_item13_a_second_signal_stops_at_once(
    signum: int, status: int, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """Ctrl-C twice: exit 130; SIGTERM twice: killed by it (a shell says 143), as its sender expects."""
    slow = {"class_path": "tests.helpers.SlowSteps", "init_args": {"seconds": 5.0}}
    process = start_fit(tmp_path, tiny_model_dir, chat_file, callbacks=[slow])
    wait_for(process, READY)
    process.send_signal(signum)
    wait_for(process, "again: stop now")
    process.send_signal(signum)
    _, rest = process.communicate(timeout=60)
    assert process.returncode == status, rest[-3000:]
    assert not list((tmp_path / "runs").rglob("interrupted-step=*.ckpt"))
