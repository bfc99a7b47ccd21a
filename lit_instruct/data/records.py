"""Read instruction data into typed records; every record remembers where it came from.

Three on-disk formats are understood, detected per file or set explicitly:

* alpaca: ``{"instruction": str, "input": str (optional), "output": str}``
* prompt/completion: ``{"prompt": str, "completion": str}``
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

Files are JSON Lines (one record per line) or a JSON array of records. Errors name the file, the
1-based line (JSONL) or record number (JSON array), and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RecordFormat = Literal["auto", "alpaca", "prompt_completion", "chat"]
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A record that cannot be used, with its location (``file:line``) and the offending field."""

    def __init__(self, source: str, message: str, reason: str = "invalid") -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.reason = reason


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str
    content: str


@dataclass(frozen=True)
class Record:
    """A conversation to train on, and where it was read from (``file:line`` or similar)."""

    messages: tuple[Message, ...]
    source: str


def detect_format(raw: dict[str, Any], source: str) -> RecordFormat:
    """Tell a record's format from its keys."""
    if "messages" in raw:
        return "chat"
    if "instruction" in raw:
        return "alpaca"
    if "prompt" in raw and "completion" in raw:
        return "prompt_completion"
    raise DataError(
        source,
        f"record has keys {sorted(raw)}; expected 'messages' (chat), 'instruction'+'output' (alpaca) "
        "or 'prompt'+'completion'",
        reason="unknown_format",
    )


def _string_field(raw: dict[str, Any], key: str, source: str, optional: bool = False) -> str:
    if key not in raw or raw[key] is None:
        if optional:
            return ""
        raise DataError(source, f"field '{key}' is missing", reason="missing_field")
    value = raw[key]
    if not isinstance(value, str):
        raise DataError(source, f"field '{key}' must be a string, got {type(value).__name__}", "bad_type")
    return value


def _chat_messages(raw: dict[str, Any], source: str) -> tuple[Message, ...]:
    turns = raw["messages"]
    if not isinstance(turns, list) or not turns:
        raise DataError(source, "field 'messages' must be a non-empty list", reason="bad_type")
    messages = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise DataError(source, f"field '{where}' must be an object with role and content", "bad_type")
        role = _string_field(turn, "role", source=f"{source}: {where}")
        if role not in ROLES:
            raise DataError(source, f"field '{where}.role' is {role!r}; expected one of {ROLES}", "bad_role")
        messages.append(Message(role, _string_field(turn, "content", source=f"{source}: {where}")))
    return tuple(messages)


def _check_conversation(messages: tuple[Message, ...], source: str) -> None:
    for i, message in enumerate(messages):
        if not message.content.strip():
            raise DataError(
                source, f"field 'messages[{i}].content' ({message.role}) is empty", "empty_content"
            )
    if messages[-1].role != "assistant":
        last = len(messages) - 1
        raise DataError(
            source,
            f"the conversation ends with a {messages[-1].role} turn (messages[{last}]); "
            "the last turn must be the assistant's answer",
            reason="no_final_answer",
        )


def to_record(raw: Any, source: str, fmt: RecordFormat = "auto") -> Record:
    """Turn one parsed JSON value into a :class:`Record`, checking its fields."""
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    if fmt == "auto":
        fmt = detect_format(raw, source)
    if fmt == "chat":
        if "messages" not in raw:
            raise DataError(source, "field 'messages' is missing", reason="missing_field")
        messages = _chat_messages(raw, source)
    elif fmt == "alpaca":
        instruction = _string_field(raw, "instruction", source)
        extra = _string_field(raw, "input", source, optional=True)
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        messages = (Message("user", prompt), Message("assistant", _string_field(raw, "output", source)))
    else:
        messages = (
            Message("user", _string_field(raw, "prompt", source)),
            Message("assistant", _string_field(raw, "completion", source)),
        )
    _check_conversation(messages, source)
    return Record(messages, source)


@dataclass(frozen=True)
class RawRecord:
    """One record as read: its text, where it is, and its parsed value or why it could not be parsed."""

    text: str
    source: str
    value: Any = None
    error: DataError | None = None


def iter_raw(path: Path) -> Iterator[RawRecord]:
    """Each record of a JSON array file or of a JSON Lines file (blank lines in between are errors,
    a truncated line is named as such)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:  # the whole file is unusable: always an error
            raise DataError(f"{path}:{err.lineno}", f"invalid JSON: {err.msg}", "invalid_json") from err
        for index, value in enumerate(values, start=1):
            yield RawRecord(json.dumps(value), f"{path}[record {index}]", value)
        return
    lines = text.splitlines()
    while lines and not lines[-1].strip():  # trailing empty lines end the file
        lines.pop()
    for lineno, line in enumerate(lines, start=1):
        source = f"{path}:{lineno}"
        if not line.strip():
            yield RawRecord(line, source, error=DataError(source, "blank line", "blank_line"))
            continue
        try:
            yield RawRecord(line, source, json.loads(line))
        except json.JSONDecodeError as err:
            if err.pos >= len(line.rstrip()) or err.msg.startswith("Unterminated string"):
                error = DataError(
                    source, f"line is truncated: the JSON ends early ({err.msg})", "truncated_line"
                )
            else:
                error = DataError(source, f"invalid JSON at column {err.colno}: {err.msg}", "invalid_json")
            yield RawRecord(line, source, error=error)


def read_records(
    path: str | Path, fmt: RecordFormat = "auto", on_bad: Callable[[RawRecord, DataError], None] | None = None
) -> list[Record]:
    """Read every record of a ``.json``/``.jsonl`` file.

    Args:
        path: the file.
        fmt: record format, or ``auto`` to tell it from each record's keys.
        on_bad: called with each bad record and its error, which is then skipped; without it the
            first bad record raises its :class:`DataError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    records = []
    for raw in iter_raw(path):
        try:
            if raw.error is not None:
                raise raw.error
            records.append(to_record(raw.value, raw.source, fmt))
        except DataError as error:
            if on_bad is None:
                raise
            on_bad(raw, error)
    return records
