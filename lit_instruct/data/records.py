"""Read instruction data into typed records; every record remembers where it came from.

Four on-disk formats are understood, detected per record or set explicitly:

* alpaca: ``{"instruction": str, "input": str (optional), "output": str}``
* prompt/completion: ``{"prompt": str, "completion": str}``
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}``

In chat and ShareGPT records an assistant turn may carry ``"train": false``: it stays in the context
but out of the loss.

Files are JSON Lines (one record per line), a JSON array of records, or tables read with Hugging Face
``datasets`` (memory-mapped, a row at a time): ``.parquet``, ``.arrow``, ``.csv``, or a ``save_to_disk``
folder. Errors name the file, the 1-based line (JSONL), record number (JSON array) or 0-based row
(tables), and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RecordFormat = Literal["auto", "alpaca", "prompt_completion", "chat", "sharegpt"]
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
"""ShareGPT's ``from`` values and the roles they are."""


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
    train: bool = True  # an assistant turn with False is context only, not in the loss


@dataclass(frozen=True)
class Record:
    """A conversation to train on, and where it was read from (``file:line`` or similar)."""

    messages: tuple[Message, ...]
    source: str


def detect_format(raw: dict[str, Any], source: str) -> RecordFormat:
    """Tell a record's format from its keys."""
    if "messages" in raw:
        return "chat"
    if "conversations" in raw:
        return "sharegpt"
    if "instruction" in raw:
        return "alpaca"
    if "prompt" in raw and "completion" in raw:
        return "prompt_completion"
    raise DataError(
        source,
        f"record has keys {sorted(raw)}; expected 'messages' (chat), 'conversations' (ShareGPT), "
        "'instruction'+'output' (alpaca) or 'prompt'+'completion'",
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


def _train_flag(turn: dict[str, Any], role: str, where: str, source: str) -> bool:
    train = turn.get("train")
    if train is None:  # absent, or null where a table's schema gave every turn the column
        return True
    if not isinstance(train, bool):
        raise DataError(source, f"field '{where}.train' must be true or false, got {train!r}", "bad_type")
    if not train and role != "assistant":
        raise DataError(
            source, f"field '{where}.train' is false on a {role} turn (only answers train)", "bad_type"
        )
    return train


def _turns(
    raw: dict[str, Any], source: str, key: str, role_key: str, text_key: str, roles: dict[str, str]
) -> tuple[Message, ...]:
    """The turns of a chat (``messages``: role/content) or ShareGPT (``conversations``: from/value)
    record, roles mapped through ``roles``."""
    turns = raw[key]
    if not isinstance(turns, list) or not turns:
        raise DataError(source, f"field '{key}' must be a non-empty list", reason="bad_type")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(
                source, f"field '{where}' must be an object with {role_key} and {text_key}", "bad_type"
            )
        name = _string_field(turn, role_key, source=f"{source}: {where}")
        if name not in roles:
            expected = tuple(roles)
            raise DataError(
                source, f"field '{where}.{role_key}' is {name!r}; expected one of {expected}", "bad_role"
            )
        role = roles[name]
        content = _string_field(turn, text_key, source=f"{source}: {where}")
        messages.append(Message(role, content, _train_flag(turn, role, where, source)))
    return tuple(messages)


def _check_conversation(
    messages: tuple[Message, ...], source: str, field: str = "messages", text: str = "content"
) -> None:
    for i, message in enumerate(messages):
        if not message.content.strip():
            raise DataError(source, f"field '{field}[{i}].{text}' ({message.role}) is empty", "empty_content")
    if messages[-1].role != "assistant":
        last = len(messages) - 1
        raise DataError(
            source,
            f"the conversation ends with a {messages[-1].role} turn ({field}[{last}]); "
            "the last turn must be the assistant's answer",
            reason="no_final_answer",
        )


def to_record(raw: Any, source: str, fmt: RecordFormat = "auto") -> Record:
    """Turn one parsed JSON value into a :class:`Record`, checking its fields."""
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    if fmt == "auto":
        fmt = detect_format(raw, source)
    if fmt in ("chat", "sharegpt"):
        key = "messages" if fmt == "chat" else "conversations"
        if key not in raw:
            raise DataError(source, f"field '{key}' is missing", reason="missing_field")
        if fmt == "chat":
            messages = _turns(raw, source, key, "role", "content", {role: role for role in ROLES})
        else:
            messages = _turns(raw, source, key, "from", "value", SHAREGPT_ROLES)
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
    if fmt == "sharegpt":
        _check_conversation(messages, source, "conversations", "value")
    else:
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


TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
"""Files read as tables through ``datasets`` (besides ``save_to_disk`` folders)."""


def iter_table_rows(path: Path) -> Iterator[RawRecord]:
    """Each row of a parquet / arrow / csv file or a ``save_to_disk`` folder, as a record."""
    import datasets

    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            splits = ", ".join(f"{path / name}" for name in dataset)
            raise DataError(
                str(path), f"holds several splits: name one of their folders ({splits})", "bad_type"
            )
    elif path.suffix == ".parquet":
        dataset = datasets.Dataset.from_parquet(str(path))
    elif path.suffix == ".csv":
        dataset = datasets.Dataset.from_csv(str(path))
    else:
        dataset = datasets.Dataset.from_file(str(path))
    for index, row in enumerate(dataset):
        yield RawRecord(json.dumps(row, default=str), f"{path}:row {index}", row)


def read_records(
    path: str | Path, fmt: RecordFormat = "auto", on_bad: Callable[[RawRecord, DataError], None] | None = None
) -> list[Record]:
    """Read every record of a ``.json``/``.jsonl`` file, a table file or a ``save_to_disk`` folder.

    Args:
        path: the file.
        fmt: record format, or ``auto`` to tell it from each record's keys.
        on_bad: called with each bad record and its error, which is then skipped; without it the
            first bad record raises its :class:`DataError`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    table = path.is_dir() or path.suffix in TABLE_SUFFIXES
    records = []
    for raw in iter_table_rows(path) if table else iter_raw(path):
        try:
            if raw.error is not None:
                raise raw.error
            records.append(to_record(raw.value, raw.source, fmt))
        except DataError as error:
            if on_bad is None:
                raise
            on_bad(raw, error)
    return records
