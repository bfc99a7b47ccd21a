"""The CLI: configs parse into complete configs, prepare is idempotent, and fit runs on the real model."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lit_instruct.cli import InstructCLI, main
from lit_instruct.model_names import prepare_smollm2
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.models.packing import PACKED_ATTENTION, attention_implementation
from tests import wandb_reader

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_parses_and_prints_a_complete_config(config: Path, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        InstructCLI(args=["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (None, 0)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["model"] in ("smollm2-135m-instruct", "smollm2-135m-vision")
    assert "tokenizer" not in printed["data"]  # linked: always the tokenizer of model.model
    assert set(printed["model"]["lora"]) == {f.name for f in fields(LoRAConfig)}

    # The printed config is itself a valid config.
    again = tmp_path / "printed.yaml"
    again.write_text(yaml.safe_dump(printed))
    with pytest.raises(SystemExit):
        InstructCLI(args=["fit", "--config", str(again), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out) == printed


def test_one_device_strategy_is_selectable_by_name_from_the_command_line(capsys) -> None:
    with pytest.raises(SystemExit):
        InstructCLI(
            args=["fit", "--config", str(CONFIGS[0]), "--trainer.strategy", "one_device", "--print_config"]
        )
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"] == "one_device"


@pytest.mark.e2e
def test_prepare_is_idempotent_and_prints_the_folder(smollm2_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lit_instruct", "prepare"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert result.stdout.strip() == f"smollm2-135m-instruct: {smollm2_path}"
    assert prepare_smollm2() == smollm2_path
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_path / name).is_file()


@pytest.mark.e2e
def test_fit_on_the_real_model_reports_before_and_after(smollm2_path: Path, tmp_path: Path, caplog) -> None:
    quickstart = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    for logger in quickstart["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(tmp_path)
    loggers = tmp_path / "loggers.yaml"
    loggers.write_text(yaml.safe_dump({"trainer": {"logger": quickstart["trainer"]["logger"]}}))
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--config",
        str(loggers),
        "--trainer.enable_progress_bar",
        "false",
        "--data.chatterbot_categories",
        "[greetings]",
        "--data.batch_size",
        "2",
        "--data.val_fraction",
        "0.2",
        "--data.eval_batch_size",
        "4",
        "--trainer.callbacks.max_new_tokens",  # SampleScores (the last callback): 4 short answers
        "8",
    ]
    with caplog.at_level("INFO"):
        main(args)
    summary = [
        r.getMessage() for r in caplog.records if "val/loss" in r.getMessage() and "->" in r.getMessage()
    ]
    assert len(summary) == 1 and "after 2 steps" in summary[0]
    adapters = sorted(p.parent.relative_to(tmp_path) for p in tmp_path.rglob("adapter_model.safetensors"))
    assert adapters == [Path("version_0/adapter"), Path("version_0/checkpoints/epoch=0-step=2-adapter")]
    assert (tmp_path / "version_0" / "loss_curves.png").is_file()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    # SampleScores (on in the quickstart): scores on metrics.csv's validation rows (before fit, after
    # step 2: logged at steps 0 and 1), the samples in samples.md and as a growing W&B table
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        validations = [row for row in csv.DictReader(rows) if row["val/loss"]]
    assert [row["step"] for row in validations] == ["0", "1"]
    for row in validations:
        assert all(0 <= float(row[f"val/gen/{key}"]) <= 1 for key in ("rougeL", "chrf", "exact_match"))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_reader.settled_history(run_file, "val/samples/path", rows=2)
    sizes = [row["val/samples/nrows"] for row in history if "val/samples/path" in row]
    assert len(sizes) == 2 and 1 <= sizes[0] <= 4 and sizes[1] == 2 * sizes[0]
    assert (tmp_path / "version_0" / "samples.md").read_text().count("### sample ") == sizes[1]


@pytest.mark.parametrize("name", ["lora.yaml", pytest.param("qlora.yaml", marks=pytest.mark.slow)])
def test_early_stopping_configs_finish_when_max_steps_stops_before_any_validation(
    name: str, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """``--trainer.max_steps`` ending mid-epoch (no validation has run) must not trip EarlyStopping."""
    args = ["fit", "--config", str(ROOT / "configs" / name), "--model.model", str(tiny_model_dir)]
    args += ["--data.train_files", f"[{chat_file}]", "--data.val_fraction", "0.3", "--data.batch_size", "1"]
    args += ["--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    if name == "qlora.yaml":
        args += ["--model.quantization.compute_dtype", "float32"]
    main(args)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_data_packing_builds_the_model_for_packed_rows(tiny_model_dir: Path, chat_file: Path) -> None:
    args = ["--model.model", str(tiny_model_dir), "--data.train_files", f"[{chat_file}]"]
    for packing in ("false", "true"):
        cli = InstructCLI(args=[*args, "--data.packing", packing], run=False)
        assert cli.model.packing == cli.datamodule.packing == (packing == "true")
        packed = attention_implementation(cli.model.base_model) == PACKED_ATTENTION["sdpa"]
        assert packed == (packing == "true")


def test_without_a_terminal_fit_prints_plain_progress_lines(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    """Under pytest stdout is no terminal (as under SLURM or nohup): no bar, a line every N steps."""
    from lit_instruct.callbacks.plain_progress import duration

    args = ["fit", "--config", str(ROOT / "configs" / "lora.yaml"), "--model.model", str(tiny_model_dir)]
    args += ["--data.train_files", f"[{chat_file}]", "--data.val_fraction", "0.3", "--data.batch_size", "1"]
    args += ["--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2", "--trainer.logger", "false"]
    args += ["--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.enable_progress_bar", "true", "--trainer.callbacks", "[]"]
    main(args)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    number = r"\d+\.\d{4} lr \d\.\de-\d\d tokens/s \d+ elapsed \d+s"
    assert len(lines) == 2
    assert re.fullmatch(rf"step 2/4 \(50%\) loss {number} eta \d+s", lines[0]), lines[0]
    assert re.fullmatch(rf"step 4/4 \(100%\) loss {number} eta 0s", lines[1]), lines[1]
    assert [duration(s) for s in (3, 123, 3723)] == ["3s", "2m03s", "1h02m03s"]


def test_fit_checks_the_data_before_loading_the_model(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    """A bad record fails in seconds with its file:line and no traceback: the model (whose weights
    here are unreadable) is never loaded."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not weights")  # loading it would fail differently
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}\n'
    )
    args = ["fit", "--config", str(ROOT / "configs" / "lora.yaml"), "--model.model", str(model)]
    args += ["--data.train_files", f"[{bad}]", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"lit-instruct: data error: {bad}:1: field 'messages[1].content' (assistant) is empty" in err
    assert "Traceback" not in err


def test_a_root_folder_from_the_command_line_holds_what_the_run_writes(tmp_path: Path) -> None:
    """The shipped configs put their loggers (and fixed checkpoint folders) under their own root:
    ``--trainer.default_root_dir DIR`` moves them under DIR; one path is a list of one file."""
    from lit_instruct.cli import CheckCLI

    data = Path(__file__).parents[1] / "examples/data/alpaca_sample.jsonl"
    for config, moved in (
        ("quickstart", ["save_dir", "save_dir"]),
        ("ddp", ["save_dir", "save_dir", "dirpath"]),
    ):
        args = [
            "--config",
            f"configs/{config}.yaml",
            "--trainer.default_root_dir",
            str(tmp_path / "elsewhere"),
        ]
        cli = CheckCLI(args=[*args, "--data.train_files", str(data)], run=False)
        trainer = cli.subcommand_config()["trainer"]
        folders = [
            entry["init_args"][key]
            for entry in [*trainer["logger"], *trainer["callbacks"]]
            for key in ("save_dir", "dirpath")
            if entry["init_args"].get(key)
        ]
        assert len(folders) == len(moved) and all(f.startswith(str(tmp_path / "elsewhere")) for f in folders)
        assert str(data) in [s.path for s in cli.datamodule.sources]


def test_the_bare_command_lists_every_command(capsys) -> None:
    from lit_instruct.cli import COMMANDS, LIGHTNING_COMMANDS

    main([])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted([*COMMANDS, *LIGHTNING_COMMANDS])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["fitt"], "lit-instruct: 'fitt' is no command; the commands are fit, validate, check"),
        (
            ["fit", "--data.batch_size", "abc"],
            'lit-instruct: config error: Parser key "data.batch_size": Expected',
        ),
        (
            ["fit", "--trainer.no_such", "3"],
            "lit-instruct: config error: --trainer.no_such: is not a setting (`lit-instruct fit --help`",
        ),
        (
            ["fit", "--trainer.precison", "32"],
            "lit-instruct: config error: --trainer.precison: is not a setting (closest: --trainer.precision)",
        ),
    ],
)
def test_a_command_line_mistake_is_one_line_with_status_2(argv: list[str], expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(expected), err


def test_16_mixed_on_the_cpu_is_bf16_mixed_said_in_our_words(tiny_model_dir, chat_file, caplog) -> None:
    """Issue 50: Lightning swapped it with a line of its own, and the base stayed fp32 under bf16."""
    from tests.helpers import checked_config, lora_fit_args

    args = lora_fit_args(
        tiny_model_dir, chat_file, "--trainer.accelerator", "cpu", "--trainer.precision", "16-mixed"
    )
    with caplog.at_level("INFO"):
        config = checked_config(args)
    assert (config["trainer"]["precision"], config["model"]["dtype"]) == ("bf16-mixed", "bfloat16")
    assert (
        "trainer.precision 16-mixed asks fp16 autocast, which is for GPUs: on the CPU bf16-mixed"
        in caplog.text
    )


def test_as_many_cpu_processes_as_cores_are_said_to_be_slower(tiny_model_dir, chat_file, caplog) -> None:
    import os

    from tests.helpers import checked_config, lora_fit_args

    cores = len(os.sched_getaffinity(0))
    devices = max(2, cores)
    args = lora_fit_args(
        tiny_model_dir, chat_file, "--trainer.accelerator", "cpu", "--trainer.devices", str(devices)
    )
    with caplog.at_level("INFO"):
        checked_config([*args, "--trainer.strategy", "ddp_lora"])
    assert f"trainer.devices {devices} on a CPU of {cores} cores: each process gets" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        checked_config(lora_fit_args(tiny_model_dir, chat_file, "--trainer.accelerator", "cpu"))
    assert "each process gets" not in caplog.text
