"""Read instruction data into typed records; every record remembers where it came from.

Three on-disk formats are understood, detected per file or set explicitly:

* alpaca: ``{"instruction": str, "input": str (optional), "output": str}``
* prompt/completion: ``{"prompt": str, "completion": str}``
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

Files are JSON Lines (one record per line) or a JSON array of records. Errors name the file, the
1-based line (JSONL) or record index (JSON array), and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    return Record(messages, source)


def _iter_raw(path: Path) -> Iterator[tuple[Any, str]]:
    """Yield ``(parsed value, location)`` for each record of a JSON or JSONL file."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}", f"invalid JSON: {err.msg}", "invalid_json") from err
        for index, value in enumerate(values):
            yield value, f"{path}[record {index}]"
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{path}:{lineno}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(source, f"invalid JSON: {err.msg}", "invalid_json") from err
        yield value, source


def read_records(path: str | Path, fmt: RecordFormat = "auto") -> list[Record]:
    """Read every record of a ``.json``/``.jsonl`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    return [to_record(value, source, fmt) for value, source in _iter_raw(path)]
