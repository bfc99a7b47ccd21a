"""What a data source holds, told from its first readable record before any model loads: preference
pairs (a ``chosen`` answer, :func:`~lit_instruct.data.records.is_pair`) or conversations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from lit_instruct.data.records import is_pair
from lit_instruct.data.sources import CHATTERBOT, DataSource, iter_source
from lit_instruct.errors import ConfigError

DataKind = Literal["pairs", "conversations"]


def data_kind(path: str) -> DataKind:
    """``pairs`` when the first record of ``path`` that parses is a preference pair, else
    ``conversations`` (also for a source with no readable record: its reader then says why)."""
    if path.startswith(CHATTERBOT):
        return "conversations"
    for raw in iter_source(DataSource(path)):
        if raw.error is None:
            return "pairs" if is_pair(raw.value) else "conversations"
    return "conversations"


def holds_pairs(paths: Sequence[str], setting: str) -> bool:
    """Whether every source of ``paths`` holds pairs (``False``: every one conversations).

    Raises:
        ConfigError: naming ``setting`` when some hold pairs and others conversations.
    """
    kinds = {path: data_kind(path) for path in paths}
    if len(set(kinds.values())) > 1:
        pairs = next(path for path, kind in kinds.items() if kind == "pairs")
        other = next(path for path, kind in kinds.items() if kind == "conversations")
        raise ConfigError(
            setting,
            f"{pairs} holds preference pairs and {other} conversations: one run scores one kind "
            "(pairs: preference metrics; conversations: loss and perplexity); give them separately",
        )
    return "pairs" in kinds.values()
