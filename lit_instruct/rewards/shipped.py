"""Rewards shipped for verifiable tasks: the exact final answer, a format, an overlong penalty.

A completion reaches a reward as TRL gives it for conversations (``[{"role": "assistant",
"content": text}]``) or as plain text; each of these takes either."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = "\\boxed{"


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is text or a list of messages, got {type(completion).__name__}")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or ``None``."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """A completion's final answer: the last ``\\boxed{...}``'s content, else its last number
    (thousands separators dropped), else ``None``."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _same_answer(found: str, expected: str) -> bool:
    """Equal as numbers when both are numbers, else as whitespace-normalized text."""
    try:
        return float(found.replace(",", "")) == float(expected.replace(",", ""))
    except ValueError:
        return " ".join(found.split()) == " ".join(expected.split())


def exact_answer(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1 where the completion's final answer (:func:`extract_final_answer`) equals the record's
    ``answer`` column, else 0 (also with no final answer)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        found = extract_final_answer(text_of(completion))
        rewards.append(float(found is not None and _same_answer(found, str(expected).strip())))
    return rewards


class FormatReward:
    """1 where the completion's text matches ``pattern`` (a regular expression, searched; with
    ``full: true`` the whole text must match), else 0."""

    def __init__(self, pattern: str, full: bool = False) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise ValueError(f"pattern {pattern!r} is no regular expression: {error}") from None
        self.pattern = pattern
        self.full = full
        self.__name__ = "format"

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        match = self.regex.fullmatch if self.full else self.regex.search
        return [float(match(text_of(c)) is not None) for c in completions]


class SoftOverlongPunishment:
    """DAPO's length penalty on completion tokens (TRL's ``get_soft_overlong_punishment``): 0 up to
    ``max_completion_length - soft_punish_cache`` tokens, then falling linearly to -1 at
    ``max_completion_length``, -1 past it."""

    def __init__(self, max_completion_length: int, soft_punish_cache: int) -> None:
        if not 0 <= soft_punish_cache <= max_completion_length:
            raise ValueError(
                f"soft_punish_cache must be in [0, max_completion_length={max_completion_length}], "
                f"got {soft_punish_cache}"
            )
        self.max_completion_length = max_completion_length
        self.soft_punish_cache = soft_punish_cache
        self.__name__ = "soft_overlong_punishment"

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any):
        free = self.max_completion_length - self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_length:
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


SHIPPED: dict[str, Callable[..., Any]] = {
    "exact_answer": exact_answer,
    "format": FormatReward,
    "soft_overlong_punishment": SoftOverlongPunishment,
}
"""The shipped rewards by short name: a function, or a class built from its ``init_args``."""
