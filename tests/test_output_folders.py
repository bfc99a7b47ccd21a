"""Writes into a folder the user named never delete what lit-instruct did not write (issue 49 item 2),
and writes killed midway leave nothing behind for long (item 12)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_instruct.cli import main
from lit_instruct.errors import ConfigError
from lit_instruct.io import OUTPUT_MARKER, atomic_directory, staging_prefix
from lit_instruct.train.checkpoint_io import SafeCheckpointIO
from tests.helpers import lora_fit_args, tiny_adapter


def users_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    return path


@pytest.fixture
def adapter(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A LoRA adapter of the tiny model, as training writes it."""
    return tiny_adapter(tiny_model_dir, tmp_path / "adapter")


def test_item2_adapter_dir_holding_a_users_files_is_refused_before_training(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    folder = users_folder(tmp_path / "mine")
    with pytest.raises(SystemExit) as stop:
        main(lora_fit_args(tiny_model_dir, chat_file, "--model.adapter_dir", str(folder)))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"lit-instruct: config error: model.adapter_dir: {str(folder)!r} holds 1 entries lit-instruct "
        "did not write (thesis.tex), which writing the folder whole would delete; name a new or empty folder"
    ]
    assert (folder / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("where", ["root", "cwd"])
def test_item2_adapter_dir_at_the_run_root_or_here_is_refused_before_training(
    where: str, tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    root = tmp_path / "runs"
    monkeypatch.chdir(tmp_path)
    adapter_dir = str(root) if where == "root" else "."
    args = lora_fit_args(tiny_model_dir, chat_file, "--trainer.default_root_dir", str(root))
    with pytest.raises(SystemExit) as stop:
        main([*args, "--model.adapter_dir", adapter_dir])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"lit-instruct: config error: model.adapter_dir: {adapter_dir!r} holds the run's folder"
    )


def test_item2_export_out_holding_a_users_files_is_refused(adapter: Path, tmp_path: Path, capsys) -> None:
    folder = users_folder(tmp_path / "exported")
    for extra in ([], ["--merge"]):
        with pytest.raises(SystemExit) as stop:
            main(["export", "--adapter", str(adapter), "--out", str(folder), *extra])
        assert stop.value.code == 2
        assert "config error: --out: " in capsys.readouterr().err
    assert sorted(os.listdir(folder)) == ["thesis.tex"]
    out = tmp_path / "fresh"
    main(["export", "--adapter", str(adapter), "--out", str(out)])
    main(["export", "--adapter", str(adapter), "--out", str(out)])  # ours: replaced
    assert (out / OUTPUT_MARKER).is_file() and (out / "adapter_model.safetensors").is_file()


def test_item2_a_folder_of_ours_is_replaced_and_a_users_is_not(tmp_path: Path) -> None:
    target = tmp_path / "out"
    for text in ("first", "second"):
        with atomic_directory(target, setting="--out") as staging:
            (staging / "weights").write_text(text)
    assert (target / "weights").read_text() == "second"
    (target / OUTPUT_MARKER).unlink()
    with (
        pytest.raises(ConfigError, match=r"--out: .* holds 1 entries"),
        atomic_directory(target, setting="--out"),
    ):
        pass
    assert (target / "weights").read_text() == "second"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_item12_leftovers_of_killed_writes_are_removed_by_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    writer = (
        "import sys, time\nfrom pathlib import Path\nfrom lit_instruct.io import atomic_directory\n"
        "with atomic_directory(Path(sys.argv[1])) as staging:\n"
        "    (staging / 'half').write_bytes(b'x' * 1000)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", writer, str(target)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    alive = [p for p in tmp_path.iterdir() if p.name.startswith(staging_prefix(target))]
    with atomic_directory(target) as staging:  # the writer is alive: its staging folder stays
        (staging / "whole").write_text("1")
    assert all(path.exists() for path in alive) and len(alive) == 1
    child.send_signal(signal.SIGKILL)
    child.wait()
    (tmp_path / ".adapter-old").mkdir()  # as a write killed between its two renames leaves it
    with atomic_directory(target) as staging:
        (staging / "whole").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert (target / "whole").read_text() == "2"


def test_item12_a_checkpoint_killed_midway_leaves_no_temporary_after_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    leftover = tmp_path / f"{staging_prefix(path)}{dead_pid()}.tmp"
    leftover.write_bytes(b"half a checkpoint")
    io = SafeCheckpointIO()
    io.save_checkpoint({"step": torch.tensor(3)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert int(io.load_checkpoint(path)["step"]) == 3


def test_item2_a_folder_an_earlier_version_wrote_is_replaced_and_files_added_to_ours_are_kept(
    tmp_path: Path,
) -> None:
    earlier = tmp_path / "earlier"  # an adapter folder from before the marker: only names we write
    earlier.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "chat_template.jinja"):
        (earlier / name).write_text("{}")
    with atomic_directory(earlier, setting="--out") as staging:
        (staging / "adapter_model.safetensors").write_text("new")
    assert (earlier / "adapter_model.safetensors").read_text() == "new"
    (earlier / "eval-results.json").write_text("the user's")  # added to a folder of ours
    with (
        pytest.raises(ConfigError, match=r"--out: .* holds 1 entries .* \(eval-results\.json\)"),
        atomic_directory(earlier, setting="--out"),
    ):
        pass
    readme_only = tmp_path / "notes"  # names we write, but no adapter or model: the user's
    readme_only.mkdir()
    (readme_only / "README.md").write_text("mine")
    with pytest.raises(ConfigError, match=r"README\.md"), atomic_directory(readme_only, setting="--out"):
        pass


def test_item2_an_adapter_checkpoint_restores_no_folder_outside_its_own(tmp_path: Path) -> None:
    from lit_instruct.callbacks import AdapterCheckpoint

    keep = AdapterCheckpoint(dirpath=tmp_path / "ckpt")
    inside, outside = str(tmp_path / "ckpt" / "a.ckpt"), str(tmp_path / "elsewhere" / "my-lora")
    state = {**keep.state_dict(), "adapters": {inside: [1, 2], outside: [3, 4]}}
    keep.load_state_dict(state)
    assert keep._adapters == {inside: (1, 2)}
