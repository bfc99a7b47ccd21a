"""Bad data at setup: raise naming file, line and field, or skip with exact counts and a rejects file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import LlamaConfig

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError
from tests.helpers import BAD_LINES, GOOD


def mixed_file(path: Path, reasons: list[str]) -> Path:
    """GOOD on odd lines, the bad line of each reason on even lines."""
    path.write_text("".join(f"{GOOD}\n{BAD_LINES[reason][0]}\n" for reason in reasons) + f"{GOOD}\n")
    return path


def test_setup_raises_at_the_first_bad_record_by_default(tiny_model_dir, tmp_path) -> None:
    path = mixed_file(tmp_path / "train.jsonl", ["empty_content", "bad_role"])
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(path)])
    with pytest.raises(
        DataError, match=re.escape(f"{path}:2: field 'messages[1].content' (assistant) is empty")
    ):
        data.setup("fit")


def test_skip_mode_counts_each_reason_and_writes_the_rejects_file(tiny_model_dir, tmp_path) -> None:
    reasons = [
        "bad_type",
        "truncated_line",
        "blank_line",
        "empty_content",
        "no_final_answer",
        "empty_content",
    ]
    train = mixed_file(tmp_path / "train.jsonl", reasons)
    val = mixed_file(tmp_path / "val.jsonl", ["unknown_format"])
    rejects = tmp_path / "out" / "rejects.jsonl"
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(train)],
        val_files=[str(val)],
        on_bad_record="skip",
        rejects_file=str(rejects),
        deduplicate=False,
    )
    data.setup("fit")

    assert len(data.train_samples) == 7 and len(data.val_samples) == 2
    skipped = {k: v for k, v in data.counts["train"].items() if k.startswith("skipped_")}
    assert skipped == {
        "skipped_bad_type": 1,
        "skipped_truncated_line": 1,
        "skipped_blank_line": 1,
        "skipped_empty_content": 2,
        "skipped_no_final_answer": 1,
    }
    assert data.counts["val"]["skipped_unknown_format"] == 1
    rows = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(row["source"], row["reason"]) for row in rows] == [
        *[(f"{train}:{2 * k}", reason) for k, reason in enumerate(reasons, start=1)],
        (f"{val}:2", "unknown_format"),
    ]
    assert rows[0]["record"] == BAD_LINES["bad_type"][0]
    assert rows[0]["error"] == f"{train}:2: field 'completion' must be a string, got int"


def test_token_ids_without_an_embedding_row_are_an_error(tokenizer, tmp_path) -> None:
    model_dir = tmp_path / "small-vocab"
    LlamaConfig(vocab_size=300, hidden_size=8, intermediate_size=8, num_attention_heads=2).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "completion": "Hello there"}) + "\n")
    data = InstructDataModule(tokenizer=str(model_dir), train_files=[str(path)], val_fraction=0.0)
    with pytest.raises(
        DataError, match=re.escape(f"{path}:1: token id ") + r"\d+ .* is >= the model's 300 embedding"
    ):
        data.setup("fit")
