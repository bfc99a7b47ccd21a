"""Formats other tools document: TRL's conversational prompt/completion, plain text, messages kept
as JSON text in a table column, and which turns train (``multi_turn: last``, ``train_on: all``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lit_instruct.data.records import Message
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.sources import read_source
from tests.test_render import expected

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
]
CONTEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
SECOND = "\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
LAST_ANSWER_ONLY = [
    (CONTEXT + "Hello there<|im_end|>" + SECOND, False),
    ("Fine, thanks.<|im_end|>", True),
    ("\n", False),
]
"""The conversation's pieces when only its last answer trains."""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def assert_sample(sample, tokenizer, pieces) -> None:
    ids, labels = expected(tokenizer, pieces)
    assert torch.equal(torch.tensor(sample.input_ids), ids)
    assert torch.equal(torch.tensor(sample.labels), labels)


def test_trl_conversational_prompt_completion_trains_the_completion_only(tokenizer, tmp_path) -> None:
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    (record,) = read_source(write_jsonl(tmp_path / "trl.jsonl", [row]))
    assert record.messages[2] == Message("assistant", "Hello there", train=False)
    (sample,), _ = ChatRenderer(tokenizer, 512).samples(record)
    assert_sample(sample, tokenizer, LAST_ANSWER_ONLY)


def test_multi_turn_last_trains_only_the_last_answer(tokenizer, tmp_path) -> None:
    (record,) = read_source(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    (sample,), split = ChatRenderer(tokenizer, 512, multi_turn="last").samples(record)
    assert not split
    assert_sample(sample, tokenizer, LAST_ANSWER_ONLY)


def test_train_on_all_labels_every_token(tokenizer, tmp_path) -> None:
    (record,) = read_source(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    (sample,), _ = ChatRenderer(tokenizer, 512, train_on="all").samples(record)
    text = CONTEXT + "Hello there<|im_end|>" + SECOND + "Fine, thanks.<|im_end|>\n"
    assert_sample(sample, tokenizer, [(text, True)])


def test_a_text_record_trains_every_token_and_ends_with_eos(tokenizer, tmp_path) -> None:
    (record,) = read_source(write_jsonl(tmp_path / "text.jsonl", [{"text": "Plain prose, no turns."}]))
    (sample,), _ = ChatRenderer(tokenizer, 512).samples(record)
    assert_sample(sample, tokenizer, [("Plain prose, no turns." + tokenizer.eos_token, True)])


def test_messages_kept_as_json_text_in_a_table_column(tmp_path) -> None:
    import datasets

    rows = [{"messages": json.dumps(CONVERSATION), "id": "a"}]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "chat.parquet")
    datasets.Dataset.from_list(rows).to_csv(tmp_path / "chat.csv", index=False)
    expected_messages = read_source(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))[
        0
    ].messages
    for name in ("chat.parquet", "chat.csv"):
        (record,) = read_source(tmp_path / name)
        assert record.messages == expected_messages
