"""A resume takes the user's settings, never the checkpoint's (issue 49 items 1, 7 and 13's bit flip):
a checkpoint fixes the run's structure, refused when the command line says otherwise, and can set no
path, no model and no ``trust_remote_code``; ``--ckpt_path last`` finds a versioned run's checkpoint."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lit_instruct.cli import main
from lit_instruct.models.lora import LoRAConfig
from tests.helpers import checked_config, lora_fit_args


def checked(args: list[str]) -> dict:
    return checked_config(args)


@pytest.fixture
def hparams(tiny_model_dir: Path) -> dict:
    """The hyper-parameters lora.yaml's module has on the tiny model (no weights read)."""
    config = checked(lora_fit_args(tiny_model_dir, tiny_model_dir / "config.json"))["model"]
    return {**config, "lora": asdict(LoRAConfig(**config["lora"])), "quantization": {"method": "none"}}


def code_folder(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path]:
    """A model folder whose ``config.json`` points at its own Python, which leaves a file when run."""
    folder = tmp_path / "hostile-model"
    folder.mkdir()
    ran = tmp_path / "code-ran"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "hostile.HostileConfig", "AutoModelForCausalLM": "hostile.Hostile"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hostile.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    for name in os.listdir(tiny_model_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    return folder, ran


def test_item1_a_checkpoint_cannot_set_the_model_or_trust_remote_code(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path, capsys
) -> None:
    hostile, ran = code_folder(tmp_path, tiny_model_dir)
    checkpoint = tmp_path / "hostile.ckpt"
    torch.save(
        {"hyper_parameters": {**hparams, "model": str(hostile), "trust_remote_code": True}}, checkpoint
    )
    args = lora_fit_args(
        tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint), "--model.trust_remote_code", "false"
    )
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lit-instruct: config error: model.model: {str(tiny_model_dir)!r} differs from ")
    assert f"trained with {str(hostile)!r}" in err and len(err.splitlines()) == 1
    assert not ran.exists()


def test_item1_a_checkpoint_cannot_set_paths_or_code_execution(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    checkpoint = tmp_path / "hostile.ckpt"
    hostile = {"trust_remote_code": True, "adapter_dir": str(victim), "learning_rate": 9.0}
    torch.save({"hyper_parameters": {**hparams, **hostile}}, checkpoint)
    model = checked(lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint)))["model"]
    assert (model["trust_remote_code"], model["adapter_dir"], model["learning_rate"]) == (False, None, 3e-4)
    assert model["model"] == str(tiny_model_dir)


def test_item1_a_checkpoint_of_another_structure_is_refused_naming_both_values(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path, capsys
) -> None:
    checkpoint = tmp_path / "rank4.ckpt"
    torch.save({"hyper_parameters": {**hparams, "lora": {**hparams["lora"], "r": 4}}}, checkpoint)
    with pytest.raises(SystemExit) as stop:
        main(lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint)))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"lit-instruct: config error: model.lora.r: 16 differs from the checkpoint {str(checkpoint)!r}"
    )
    assert "trained with 4" in err
    same = checked(
        lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint), "--model.lora.r", "4")
    )
    assert same["model"]["lora"]["r"] == 4


def test_item1_a_resume_keeps_this_launchs_low_memory_load(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path
) -> None:
    """A checkpoint written by a 2-process ``low_memory_load`` FSDP run resumes in a launch of 1."""
    checkpoint = tmp_path / "fsdp.ckpt"
    torch.save({"hyper_parameters": {**hparams, "low_memory_load": True}}, checkpoint)
    model = checked(lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint)))["model"]
    assert model["low_memory_load"] is False


def test_item7_ckpt_path_last_finds_the_checkpoint_of_an_earlier_version_folder(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path, caplog
) -> None:
    root = tmp_path / "runs"
    older, newer = root / "version_0" / "checkpoints", root / "version_1" / "checkpoints"
    for folder in (older, newer):
        folder.mkdir(parents=True)
    torch.save({"hyper_parameters": hparams}, older / "epoch=0-step=2.ckpt")
    torch.save({"hyper_parameters": hparams}, newer / "epoch=0-step=4.ckpt")
    os.utime(older / "epoch=0-step=2.ckpt", (1, 1))
    args = lora_fit_args(
        tiny_model_dir, chat_file, "--trainer.default_root_dir", str(root), "--ckpt_path", "last"
    )
    assert checked(args)["ckpt_path"] == str(newer / "epoch=0-step=4.ckpt")
    fresh = lora_fit_args(tiny_model_dir, chat_file, "--trainer.default_root_dir", str(tmp_path / "new"))
    with caplog.at_level("INFO"):
        assert checked([*fresh, "--ckpt_path", "last"])["ckpt_path"] is None
    assert "no checkpoint under" in caplog.text and "starting at step 0" in caplog.text


def test_item13_a_bit_flipped_checkpoint_is_refused(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path, capsys
) -> None:
    checkpoint = tmp_path / "flipped.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": {"w": torch.randn(4096)}}, checkpoint)
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the tensor's record: torch.load reads it without a word
    checkpoint.write_bytes(data)
    assert torch.load(checkpoint, weights_only=True)["hyper_parameters"]["model"]
    with pytest.raises(SystemExit) as stop:
        main(lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(checkpoint)))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "lit-instruct: config error: ckpt_path:" in err and "fails its CRC check" in err


def test_a_missing_checkpoint_is_one_line(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(lora_fit_args(tiny_model_dir, chat_file, "--ckpt_path", str(tmp_path / "nope.ckpt")))
    assert stop.value.code == 2
    assert "ckpt_path: " in capsys.readouterr().err


def adapter_weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The LoRA weights a checkpoint file holds, named as its adapter folder names them."""
    stored = torch.load(checkpoint, weights_only=True)["state_dict"]
    return {k.removeprefix("model.").replace(".default.", "."): v for k, v in stored.items()}


@pytest.mark.slow
def test_item3_a_resume_keeps_every_kept_checkpoints_adapter_as_it_was(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from lit_instruct.callbacks import AdapterCheckpoint
    from tests.helpers import make, trainer

    def fit(max_steps: int, ckpt_path: Path | None = None) -> None:
        module, data = make(tiny_model_dir, chat_file)
        keep = AdapterCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2, monitor="train/loss", save_top_k=-1
        )
        run = trainer(tmp_path, max_steps=max_steps, limit_val_batches=0, enable_checkpointing=True)
        run.callbacks.insert(0, keep)
        run.fit(module, datamodule=data, ckpt_path=ckpt_path)

    fit(4)
    first = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(first) == 2
    (AdapterCheckpoint.adapter_dir(first[0]) / "adapter_model.safetensors").unlink()  # lost: rebuilt
    fit(8, ckpt_path=first[-1])
    checkpoints = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(checkpoints) == 4
    for checkpoint in checkpoints:
        written = load_file(AdapterCheckpoint.adapter_dir(checkpoint) / "adapter_model.safetensors")
        expected = adapter_weights_of(checkpoint)
        assert written.keys() == expected.keys()
        for name, weight in expected.items():
            assert torch.equal(written[name], weight), (checkpoint.name, name)


def test_item7_ckpt_path_last_takes_the_furthest_step_whatever_the_file_times(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path
) -> None:
    folder = tmp_path / "runs" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"hyper_parameters": hparams, "global_step": 6}, folder / "b.ckpt")
    torch.save({"hyper_parameters": hparams, "global_step": 2}, folder / "a.ckpt")  # written later
    args = lora_fit_args(tiny_model_dir, chat_file, "--trainer.default_root_dir", str(tmp_path / "runs"))
    assert checked([*args, "--ckpt_path", "last"])["ckpt_path"] == str(folder / "b.ckpt")


def test_a_resume_without_a_logger_never_writes_over_the_users_own_config_yaml(
    tiny_model_dir: Path, chat_file: Path, hparams: dict, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("# my own notes\nmodel: {}\n")
    torch.save({"hyper_parameters": hparams, "global_step": 2}, tmp_path / "x.ckpt")
    args = lora_fit_args(
        tiny_model_dir, chat_file, "--trainer.logger", "false", "--ckpt_path", str(tmp_path / "x.ckpt")
    )
    with pytest.raises(SystemExit) as stop:
        main([*args, "--trainer.default_root_dir", "."])
    assert stop.value.code == 2
    assert "holds a config.yaml no fit saved" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("# lightning.pytorch==2.6.6\nmodel: {}\n")  # one a fit saved
    checked([*args, "--trainer.default_root_dir", "."])


@pytest.mark.slow
def test_a_mid_epoch_resume_has_no_false_warning_and_counts_its_own_tokens(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, caplog
) -> None:
    """Issue 50: Lightning warned that our loader was not resumable (the feed keeps its place), and
    the resumed fit's tokens/s divided the tokens from before the resume by the time after it."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import make, trainer

    def fit(max_steps: int, ckpt_path: Path | None = None):
        module, data = make(tiny_model_dir, chat_file, batch_size=1)
        keep = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        run = trainer(tmp_path, max_steps=max_steps, limit_val_batches=0, enable_checkpointing=True)
        run.callbacks.insert(0, keep)
        run.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module

    first = fit(2)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        resumed = fit(4, ckpt_path=next((tmp_path / "ckpt").glob("*step=2.ckpt")))
    assert not [w for w in caught if "not resumable" in str(w.message)]
    done = next(line for line in caplog.text.splitlines() if "fit done in" in line)
    assert "4 optimizer steps (2 since the resume)" in done
    assert f"{resumed.tokens_seen - first.tokens_seen:,} tokens (" in done
