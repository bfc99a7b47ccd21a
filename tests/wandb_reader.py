"""Read an offline W&B run file (``run-<id>.wandb``) with wandb's own protobuf ``Record`` messages.

The file is a ``:W&B`` header followed by a LevelDB-style log: 32 KiB blocks of chunks, each with a
7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def records(path: Path) -> Iterator[Any]:
    """Every ``Record`` in the run file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):  # a chunk the service is still writing
            return
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """The run's logged rows, as ``{key: value}``."""
    return [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        for record in records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def settled_history(path: Path, key: str, rows: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    """:func:`history` once ``rows`` rows carry ``key``: W&B's service process writes the run file on its
    own schedule, and under load the last records can land after ``finish()`` has returned."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            found = history(path)
        except DecodeError:  # read while a record was half written: read again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        if sum(key in row for row in found) >= rows or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def config(path: Path) -> dict[str, Any]:
    """The run config: the run record's, updated by later config records."""
    values: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = (
            record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        )
        for item in updates:
            values["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return values
