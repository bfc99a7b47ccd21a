"""Nothing lost, nothing untrusted executed: atomic writes, weights_only loads (signals: test_signals)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from lit_instruct.adapter_folder import save_adapter
from lit_instruct.cli import InstructCLI
from lit_instruct.train.checkpoint_io import SafeCheckpointIO
from tests.helpers import make, trainer


class Payload:
    """Unpickling this would run code: it touches a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_checkpoint_is_refused_without_running_it(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    marker, evil = tmp_path / "pwned", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Payload(marker)}, evil)
    module, data = make(tiny_model_dir, chat_file)
    with pytest.raises(Exception, match="Weights only load failed"):
        trainer(tmp_path, plugins=[SafeCheckpointIO()]).fit(module, datamodule=data, ckpt_path=evil)
    with pytest.raises(ValueError, match="weights_only=True only"):
        SafeCheckpointIO().load_checkpoint(evil, weights_only=False)
    assert not marker.exists()


def test_the_cli_trainer_uses_the_safe_checkpoint_io(tiny_model_dir, chat_file) -> None:
    args = ["--model.model", str(tiny_model_dir), "--data.train_files", f"[{chat_file}]"]
    cli = InstructCLI(args=args, run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, SafeCheckpointIO)


def test_a_failed_checkpoint_write_leaves_the_previous_file(tmp_path, monkeypatch) -> None:
    io, path = SafeCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, path)

    def broken_save(obj, f) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": torch.tensor(2)}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left


def test_a_failed_adapter_save_leaves_the_previous_adapter(
    tiny_model_dir, chat_file, tmp_path, monkeypatch
) -> None:
    module, _ = make(tiny_model_dir, chat_file)
    target = save_adapter(module.model, tmp_path / "out" / "adapter")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    torch.nn.init.normal_(next(p for n, p in module.model.named_parameters() if "lora_B" in n))

    def broken_save_pretrained(self, directory, **kwargs) -> None:
        (Path(directory) / "adapter_model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(PeftModel, "save_pretrained", broken_save_pretrained)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        save_adapter(module.model, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["adapter"]  # no staging folder left

    monkeypatch.undo()
    with torch.no_grad():
        next(p for n, p in module.model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(ValueError, match="contains NaN or Inf; refusing to write it"):
        save_adapter(module.model, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_written_files_get_the_modes_the_umask_gives(tmp_path) -> None:
    """Staging folders, temporary files and safetensors are private when created: what lands is
    readable as a plain write would be (0644 / 0755 under umask 022), executables stay executable."""
    import os
    import stat

    from safetensors.torch import save_file

    from lit_instruct.io import atomic_directory, write_atomically

    old = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "adapter") as staging:
            save_file({"a": torch.zeros(2)}, str(staging / "adapter_model.safetensors"))
            (staging / "run.sh").write_text("#!/bin/sh\n")
            (staging / "run.sh").chmod(0o700)
        write_atomically(tmp_path / "report.html", "<p>ok</p>")
    finally:
        os.umask(old)

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(tmp_path / "adapter") == 0o755
    assert mode(tmp_path / "adapter" / "adapter_model.safetensors") == 0o644
    assert mode(tmp_path / "adapter" / "run.sh") == 0o755
    assert mode(tmp_path / "report.html") == 0o644
