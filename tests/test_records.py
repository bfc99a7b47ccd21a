"""Reading records: format detection and errors that name the file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_instruct.data.chatterbot import read_chatterbot
from lit_instruct.data.records import DataError, Message, read_records


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_three_formats_are_detected_per_file(tmp_path: Path) -> None:
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add", "input": "1 and 2", "output": "3"}])
    pc = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "completion": "Hello"}])
    chat = tmp_path / "c.json"
    chat.write_text(
        json.dumps([{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}])
    )

    (a,) = read_records(alpaca)
    assert a.messages == (Message("user", "Add\n\n1 and 2"), Message("assistant", "3"))
    assert a.source == f"{alpaca}:1"
    (p,) = read_records(pc)
    assert p.messages == (Message("user", "Hi"), Message("assistant", "Hello"))
    (c,) = read_records(chat)
    assert c.messages == (Message("user", "Q"), Message("assistant", "A"))
    assert c.source == f"{chat}[record 0]"


def test_alpaca_without_input_uses_instruction_alone(tmp_path: Path) -> None:
    (record,) = read_records(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi", "output": "hi"}]))
    assert record.messages[0] == Message("user", "Say hi")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "x", "completion": 3}', r":2: field 'completion' must be a string, got int"),
        ('{"instruction": "x"}', r":2: field 'output' is missing"),
        ('{"text": "x"}', r":2: record has keys \['text'\]"),
        ('{"prompt": "x", ', r":2: invalid JSON"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r":2: field 'messages\[0\].role' is 'bot'"),
    ],
)
def test_errors_name_file_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "completion": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=str(path).replace(".", r"\.") + expected):
        read_records(path)


def test_chatterbot_conversations_alternate_user_and_assistant() -> None:
    records = read_chatterbot(["greetings"])
    assert len(records) > 10
    for record in records:
        roles = [m.role for m in record.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert "greetings.yml[conversation " in record.source
