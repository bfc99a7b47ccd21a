"""JSON as records are read: what ``json.loads`` lets through silently, or ends in a traceback, refused
with a reason the readers turn into a ``DataError`` naming where it is.

``json.loads`` keeps the last of a repeated key (``{"messages": a, "messages": b}`` drops ``a``
unseen), raises ``RecursionError`` on a value nested deeper than Python recurses and a plain
``ValueError`` on an integer over Python's digit limit. Files are decoded with
``errors="surrogateescape"``, so that a byte that is not UTF-8 reaches the reader as a character of
its own (:data:`INVALID_UTF8`) and is named by line instead of failing the whole file's decoding.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from pathlib import Path
from typing import Any

INVALID_UTF8 = re.compile("[\udc80-\udcff]")
"""A byte that is not UTF-8, as ``errors="surrogateescape"`` decodes it."""
_VALUE_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class JSONProblem(ValueError):
    """JSON that parses (or would) but cannot be used: ``reason`` is the counter name; ``end`` is where
    the value ends when known."""

    def __init__(self, message: str, reason: str, end: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.end = end


def byte_of(match: re.Match[str]) -> str:
    """The undecodable byte an :data:`INVALID_UTF8` match stands for, as ``byte 0xe9``."""
    return f"byte 0x{ord(match.group()) - 0xDC00:02x}"


def readable(text: str) -> str:
    """``text`` with its undecodable bytes written ``\\xe9`` (so that a rejects file can hold it)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def is_utf8(path: Path) -> bool:
    """Whether the whole file decodes as UTF-8 (read in blocks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as handle:
            while block := handle.read(1 << 22):
                decoder.decode(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def value_end(text: str, start: int) -> int | None:
    """Where the JSON array or object at ``start`` ends (brackets counted, strings skipped), or None
    when it does not: a value too deep to parse is stepped over this way."""
    depth = 0
    for token in _VALUE_TOKENS.finditer(text, start):
        if token.group()[0] == '"':
            continue
        depth += 1 if token.group() in "[{" else -1
        if depth == 0:
            return token.end()
    return None


class StrictDecoder:
    """``json.loads`` that raises :class:`JSONProblem` for a repeated key (at any depth), nesting
    deeper than the parser recurses, and any other ``ValueError`` than a ``JSONDecodeError`` (which
    it lets through, with its position)."""

    def __init__(self) -> None:
        self._repeated: list[str] = []
        self._decoder = json.JSONDecoder(object_pairs_hook=self._object)

    def _object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) < len(pairs):
            keys = [key for key, _ in pairs]
            self._repeated += [key for key in value if keys.count(key) > 1]
        return value

    def loads(self, text: str) -> Any:
        """The JSON value ``text`` holds (whitespace around it allowed, nothing else)."""
        return self._checked(lambda: (self._decoder.decode(text), None))[0]

    def raw_decode(self, text: str, start: int) -> tuple[Any, int]:
        """The JSON value at ``start`` and where it ends."""
        return self._checked(lambda: self._decoder.raw_decode(text, start))

    def _checked(self, parse: Any) -> tuple[Any, Any]:
        self._repeated = []
        try:
            value, end = parse()
        except json.JSONDecodeError:
            raise
        except RecursionError as error:
            raise JSONProblem(
                f"JSON nested too deeply (deeper than Python's parser goes, about {sys.getrecursionlimit()} "
                "levels)",
                "nested_too_deep",
            ) from error
        except ValueError as error:
            raise JSONProblem(f"invalid JSON: {error}", "invalid_json") from error
        if self._repeated:
            raise JSONProblem(
                f"key {self._repeated[0]!r} appears more than once in an object (JSON readers keep one of "
                "them and drop the other unseen): keep one",
                "duplicate_key",
                end,
            )
        return value, end
