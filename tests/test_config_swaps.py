"""The loss and the optimizer are chosen in YAML (or on the command line), through ``lit-instruct fit``."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from lit_instruct.cli import InstructCLI
from lit_instruct.loss.fused import FusedLinearCrossEntropy
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.loss.table import LOSSES, LossChoice, resolve_loss

ROOT = Path(__file__).resolve().parent.parent


def fit(tiny_model_dir: Path, chat_file: Path, tmp_path: Path, *extra: str) -> InstructCLI:
    args = ["fit", "--config", str(ROOT / "configs" / "lora.yaml"), "--model.model", str(tiny_model_dir)]
    args += ["--data.train_files", f"[{chat_file}]", "--data.val_fraction", "0.3", "--data.batch_size", "2"]
    args += ["--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.callbacks", "[]", "--validate_before_fit", "false"]
    return InstructCLI(args=[*args, *extra])


def test_the_loss_is_set_in_the_config(tiny_model_dir, chat_file, tmp_path) -> None:
    default = fit(tiny_model_dir, chat_file, tmp_path / "default")
    assert isinstance(default.model.loss_fn, FusedLinearCrossEntropy)
    reference = fit(tiny_model_dir, chat_file, tmp_path / "reference", "--model.loss", "reference")
    assert reference.model.loss_fn is reference_linear_cross_entropy
    assert reference.model.hparams["loss"] == "reference"
    custom = fit(
        tiny_model_dir,
        chat_file,
        tmp_path / "custom",
        "--model.loss",
        '{"class_path": "lit_instruct.loss.fused.FusedLinearCrossEntropy", "init_args": {"chunk_size": 7}}',
    )
    assert isinstance(custom.model.loss_fn, FusedLinearCrossEntropy) and custom.model.loss_fn.chunk_size == 7


def test_an_optimizer_set_in_the_config_trains_the_adapters_on_the_schedule(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    cli = fit(
        tiny_model_dir,
        chat_file,
        tmp_path,
        "--model.optimizer",
        "torch.optim.SGD",
        "--model.optimizer.lr",
        "0.05",
    )
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    trainable = {id(p) for p in cli.model.parameters() if p.requires_grad}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == trainable
    assert optimizer.param_groups[0]["initial_lr"] == 0.05  # the warmup-cosine schedule runs on its lr
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_loss_that_is_no_loss_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"model\.loss must be one of fused, reference or a callable loss, got 'liger'"
    ):
        resolve_loss("liger")  # type: ignore[arg-type]
    assert isinstance(resolve_loss("fused"), FusedLinearCrossEntropy)
    assert resolve_loss("reference") is reference_linear_cross_entropy


def test_the_loss_names_the_config_accepts_are_the_table_s() -> None:
    assert set(typing.get_args(LossChoice)) == set(LOSSES)


def test_a_yaml_file_swaps_loss_and_optimizer(tiny_model_dir, chat_file, tmp_path) -> None:
    swaps = tmp_path / "swaps.yaml"
    swaps.write_text(
        "model:\n  loss: reference\n  optimizer:\n    class_path: torch.optim.SGD\n    init_args:\n"
        "      lr: 0.05\n      momentum: 0.5\n"
    )
    cli = fit(tiny_model_dir, chat_file, tmp_path, "--config", str(swaps))
    assert cli.model.loss_fn is reference_linear_cross_entropy
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.5
    assert cli.trainer.global_step == 2
