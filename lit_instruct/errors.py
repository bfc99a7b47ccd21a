"""The error a user's setting raises: exit status 2 and one line at the command line, no traceback."""

from __future__ import annotations

from typing import Any


def closest(name: str, names: list[str]) -> str:
    """`` (closest: X)`` for the name of ``names`` nearest ``name`` (a misspelt setting or value), or
    nothing."""
    import difflib

    found = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (closest: {found[0]})" if found else ""


class ConfigError(ValueError):
    """A setting the run cannot honour. Its text is one line: the setting's dotted name, then what
    is wrong with its value and what would be right (``model.lora.r: must be a positive integer, got
    -4``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt intact when raised in a worker process
        return (type(self), (self.setting, str(self).removeprefix(f"{self.setting}: ")))
