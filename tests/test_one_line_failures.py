"""Failures a user can act on end in one line, not a traceback (issue 49 item 11): a full disk naming
the file, a truncated adapter naming its file, a chat template reaching past Jinja's sandbox, a refit
into the root folder of an earlier run without a logger (before the model loads)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_instruct.cli import main
from tests.ci import require_or_skip
from tests.helpers import tiny_adapter

HOSTILE_TEMPLATE = "{{ ''.__class__.__mro__ }}{% for m in messages %}{{ m.content }}{% endfor %}"


def fit_command(model: Path, chat_file: Path, root: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--model.model",
        str(model),
        "--model.lora.r",
        "4",
        "--data.train_files",
        f"[{chat_file}]",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.logger",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.default_root_dir",
        str(root),
        "--validate_before_fit",
        "false",
        *extra,
    ]


@pytest.fixture
def adapter(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A LoRA adapter of the tiny model, as training writes it."""
    return tiny_adapter(tiny_model_dir, tmp_path / "adapter")


@pytest.mark.slow
def test_item11_a_full_disk_is_one_line_naming_the_file(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """A real full disk: a 64 KiB tmpfs, in a mount namespace of the fit's own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        require_or_skip("a tmpfs needs root and unshare")
    root = tmp_path / "full"
    root.mkdir()
    fit = " ".join(
        f"'{arg}'"
        for arg in [sys.executable, "-m", "lit_instruct", *fit_command(tiny_model_dir, chat_file, root)]
    )
    script = f"mount -t tmpfs -o size=64k tmpfs '{root}' && exec {fit}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lit-instruct: disk full: No space left on device writing "), done.stderr[-3000:]
    assert str(root / "checkpoints") in last and "Traceback" not in done.stderr


def test_item11_a_truncated_adapter_is_one_line_naming_its_file(adapter: Path, capsys) -> None:
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--adapter", str(adapter), "--prompt", "hi"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"lit-instruct: config error: --adapter: {weights} is truncated: ")


def test_item11_a_template_reaching_past_the_sandbox_is_one_line(
    tiny_model_dir: Path, chat_file: Path, adapter: Path, tmp_path: Path, capsys
) -> None:
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    for argv in (
        ["generate", "--adapter", str(adapter), "--prompt", "hi", "--chat-template", str(template)],
        [
            "inspect",
            *fit_command(tiny_model_dir, chat_file, tmp_path / "r")[1:],
            "--data.chat_template",
            str(template),
        ],
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-instruct")]
        assert "chat_template" in line or "--chat-template" in line
        assert "the template does what Jinja's sandbox forbids (access to attribute '__class__'" in line
    model = tmp_path / "hostile-model"  # the model's own template: found when it renders
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("lit-instruct: template error: the chat template does what Jinja's sandbox forbids")
    )


def test_item11_a_refit_into_an_earlier_runs_root_without_a_logger_is_refused_before_loading(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "config.yaml").write_text("trainer: {}\n")  # what the earlier run left
    with pytest.raises(SystemExit) as stop:
        main(fit_command(tiny_model_dir, chat_file, root))
    assert stop.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line.startswith(f"lit-instruct: config error: trainer.default_root_dir: {str(root)!r} holds an")
