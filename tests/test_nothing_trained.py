"""A run that would train nothing is a mistake named in one line (exit 2), before any weights load
where the data tells it, in ``fit``, ``check`` and ``inspect`` alike; never a success (issue 50)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lit_instruct.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unreadable_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config and tokenizer, with weights no loader can read: a refusal that comes
    after the weights are read fails on them instead."""
    model = tmp_path_factory.mktemp("unreadable") / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not weights")
    return model


def args(command: str, model: Path, data: Path, tmp_path: Path, *extra: str) -> list[str]:
    config = "dpo.yaml" if "pairs" in data.name else "lora.yaml"
    root = ["--trainer.default_root_dir", str(tmp_path / "runs")] if command != "inspect" else []
    data_args = ["--data.train_files", f"[{data}]", "--data.val_fraction", "0"]
    return [
        command,
        "--config",
        str(ROOT / "configs" / config),
        "--model.model",
        str(model),
        *data_args,
        *root,
        *extra,
    ]


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-instruct: config")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["fit", "check", "inspect"])
def test_an_empty_file_is_refused_naming_it(
    command: str, unreadable_model: Path, tmp_path: Path, capsys
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = refused(args(command, unreadable_model, empty, tmp_path), capsys)
    assert line == f"lit-instruct: config error: data.train_files: no record in {empty} (an empty file?)"


def test_an_empty_pairs_file_is_refused_too(unreadable_model: Path, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "pairs.jsonl"
    empty.write_text("")
    line = refused(args("fit", unreadable_model, empty, tmp_path), capsys)
    assert line == f"lit-instruct: config error: data.train_files: no record in {empty} (an empty file?)"


@pytest.mark.parametrize("command", ["fit", "check", "inspect"])
def test_every_response_truncated_away_names_max_seq_len_and_the_counts(
    command: str, unreadable_model: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    samples = len(chat_file.read_text().splitlines())
    line = refused(args(command, unreadable_model, chat_file, tmp_path, "--data.max_seq_len", "4"), capsys)
    assert line == (
        f"lit-instruct: config error: data.max_seq_len: 4: every response truncated away ({samples} of "
        f"{samples} samples of {chat_file}); raise it"
    )


def test_every_record_skipped_as_bad_names_on_bad_record(
    unreadable_model: Path, tmp_path: Path, capsys
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"x": 1}) + "\n" + json.dumps({"y": 2}) + "\n")
    line = refused(args("fit", unreadable_model, bad, tmp_path, "--data.on_bad_record", "skip"), capsys)
    assert line.startswith("lit-instruct: config error: data.on_bad_record: skip: every record of ")
    assert "skipped_unknown_format=2" in line


@pytest.mark.parametrize(
    ("setting", "value"), [("max_steps", "0"), ("max_epochs", "0"), ("limit_train_batches", "0")]
)
@pytest.mark.parametrize("command", ["fit", "check"])
def test_a_trainer_setting_that_leaves_no_step_is_refused(
    command: str, setting: str, value: str, unreadable_model: Path, chat_file: Path, tmp_path: Path, capsys
) -> None:
    line = refused(
        args(command, unreadable_model, chat_file, tmp_path, f"--trainer.{setting}", value), capsys
    )
    assert line.startswith(f"lit-instruct: config error: trainer.{setting}: {value} trains nothing")


@pytest.mark.slow
def test_a_resume_at_max_steps_takes_no_step_says_so_and_prints_no_try_it_line(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, caplog
) -> None:
    """Resumed from a checkpoint at ``max_steps`` already (a job requeued as its last step ended):
    done, said in one line; no "try it" for an adapter this fit did not train."""
    first = args(
        "fit", tiny_model_dir, chat_file, tmp_path, "--trainer.max_steps", "2", "--trainer.max_epochs", "-1"
    )
    first += ["--validate_before_fit", "false", "--data.val_files", f"[{chat_file}]"]  # for val/loss
    main(first)
    checkpoint = max((tmp_path / "runs").rglob("*.ckpt"), key=lambda path: path.stat().st_mtime_ns)
    caplog.clear()
    main([*first, "--ckpt_path", str(checkpoint)])
    said = caplog.text
    assert "it took no optimizer step" in said and "had reached trainer.max_steps 2 already" in said
    assert "try it" not in said


@pytest.mark.parametrize("command", ["fit", "check"])
def test_every_pair_cut_below_the_floor_names_max_seq_len_and_the_counts(
    command: str, unreadable_model: Path, tmp_path: Path, capsys
) -> None:
    """max_seq_len 8 keeps 4 tokens of each answer: a preference between first words is refused."""
    pairs = tmp_path / "pairs.jsonl"
    answer = "The answer takes a good many words to say, more than a few tokens can hold, {}."
    rows = [
        {"prompt": f"Question {n}?", "chosen": answer.format("yes"), "rejected": answer.format(f"no {n}")}
        for n in range(3)
    ]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = refused(args(command, unreadable_model, pairs, tmp_path, "--data.max_seq_len", "8"), capsys)
    assert line == (
        "lit-instruct: config error: data.max_seq_len: 8: every pair's answers cut to under 16 tokens "
        f"(3 of 3 pairs of {pairs}); raise it"
    )
