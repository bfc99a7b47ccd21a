"""Preference records -> chosen and rejected samples sharing their prompt's tokens, and their batches.

Two of TRL's preference layouts are read:

- explicit prompt: ``prompt``, ``chosen``, ``rejected``; each a string (the prompt a user turn, the
  answers assistant turns) or a list of chat messages (the answers' lists hold the answer turn);
- implicit prompt: ``chosen`` and ``rejected`` whole conversations (message lists) that share every
  turn but the last, which is each one's assistant answer.

Each side becomes a chat record rendered by :class:`~lit_instruct.data.render.ChatRenderer` with
``multi_turn="last"``: earlier answers are context, the last answer (and its end-of-turn token) is
labelled. The two renderings must hold the same tokens before their answers (checked per record);
a record where they differ is refused naming its file, line and field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.records import DataError, Record, to_record
from lit_instruct.data.render import ChatRenderer, Sample
from lit_instruct.labels import IGNORE_INDEX

FIELDS = frozenset({"prompt", "chosen", "rejected"})


@dataclass(frozen=True)
class PreferenceRecord:
    """The chosen and rejected conversations of one preference pair (same context, last answer differs)."""

    chosen: Record
    rejected: Record
    source: str
    unused: tuple[str, ...] = ()


def _messages(value: Any, field: str, role: str, source: str) -> list[dict[str, Any]]:
    """A field as chat messages: a string is one ``role`` turn, a list is taken as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value
    raise DataError(source, f"field '{field}' must be a string or a non-empty list of messages", "bad_type")


_INDEX = re.compile(r"messages\[(\d+)\]")


def _record(parts: list[tuple[str, list[dict[str, Any]]]], source: str) -> Record:
    """The chat record of the concatenated ``(field, messages)`` parts; errors name the user's field
    (``chosen[0].content``) rather than the concatenation's (``messages[2].content``)."""
    where = [(field, k) for field, messages in parts for k in range(len(messages))]
    try:
        return to_record({"messages": [m for _, messages in parts for m in messages]}, source, "chat")
    except DataError as error:

        def rename(match: re.Match[str]) -> str:
            field, k = where[int(match.group(1))]
            return f"{field}[{k}]"

        raise DataError(source, _INDEX.sub(rename, error.message), error.reason) from error


def _shared_prefix(chosen: list[Any], rejected: list[Any]) -> int:
    """How many leading messages the two conversations share."""
    count = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        count += 1
    return count


def to_preference_record(raw: Any, source: str) -> PreferenceRecord:
    """One JSON object (or table row) in an explicit- or implicit-prompt layout, checked.

    Raises:
        DataError: for a missing or mistyped field, answers that are not one assistant turn each,
            implicit conversations that do not share all but their last turn.
    """
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    for field in ("chosen", "rejected"):
        if raw.get(field) is None:
            raise DataError(
                source, f"field '{field}' is missing (a preference pair needs both answers)", "missing_field"
            )
    unused = tuple(sorted(set(raw) - FIELDS))
    if "prompt" in raw:
        prompt = _messages(raw["prompt"], "prompt", "user", source)
        answers = {f: _messages(raw[f], f, "assistant", source) for f in ("chosen", "rejected")}
    else:
        chosen, rejected = (_messages(raw[f], f, "assistant", source) for f in ("chosen", "rejected"))
        if isinstance(raw["chosen"], str) or isinstance(raw["rejected"], str):
            raise DataError(
                source,
                "without 'prompt', 'chosen' and 'rejected' must be whole conversations (message lists)",
                "bad_type",
            )
        shared = _shared_prefix(chosen, rejected)
        if shared == 0 or shared != len(chosen) - 1 or shared != len(rejected) - 1:
            raise DataError(
                source,
                f"fields 'chosen' and 'rejected' share {shared} leading messages; an implicit prompt needs "
                f"them to differ in their last message only (chosen has {len(chosen)}, "
                f"rejected {len(rejected)})",
                "bad_pair",
            )
        prompt = chosen[:shared]
        answers = {"chosen": chosen[shared:], "rejected": rejected[shared:]}
    for field, turns in answers.items():
        if len(turns) != 1 or not isinstance(turns[0], dict) or turns[0].get("role") != "assistant":
            raise DataError(source, f"field '{field}' must be one assistant turn", "bad_pair")
    prompt_field = "prompt" if "prompt" in raw else "chosen"
    return PreferenceRecord(
        _record([(prompt_field, prompt), ("chosen", answers["chosen"])], source),
        _record([(prompt_field, prompt), ("rejected", answers["rejected"])], source),
        source,
        unused,
    )


@dataclass(frozen=True)
class PreferencePair:
    """Tokenized chosen and rejected samples: the same ``prompt_length`` first tokens, labels only on
    each answer; ``truncated`` when the pair was cut to fit."""

    chosen: Sample
    rejected: Sample
    prompt_length: int
    truncated: bool = False


def _prompt_length(sample: Sample, field: str, source: str) -> int:
    """Tokens before the sample's first label (its answer)."""
    first = next((k for k, label in enumerate(sample.labels) if label != IGNORE_INDEX), None)
    if first is None:
        raise DataError(source, f"field '{field}': the answer has no tokens", "empty_content")
    return first


class PreferenceRenderer:
    """Render preference records into :class:`PreferencePair` with a :class:`ChatRenderer`'s masks.

    Args:
        tokenizer: a fast ``transformers`` tokenizer.
        max_seq_len: longest chosen or rejected sequence; over it, both answers are cut to the same
            budget (at least half of it) and the prompt keeps its end.
        chat_template: overrides the tokenizer's template, as for SFT.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template: str | None = None) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        # rendered whole (earlier answers as context), cut here so that both answers are cut alike
        self.renderer = ChatRenderer(tokenizer, 2**62, chat_template, multi_turn="last")
        self.max_seq_len = max_seq_len

    def _render(self, record: Record) -> Sample:
        samples, _ = self.renderer.samples(record)
        return samples[-1]  # the last answer's (the only one trained)

    def __call__(self, record: PreferenceRecord) -> PreferencePair:
        """The pair, checked to share the prompt's tokens.

        Raises:
            DataError: (``prompt_tokens_differ``) when the chosen and rejected renderings differ before
                their answers (a template that renders the prompt differently per answer, or a merge
                of the prompt's last token with the answer's first).
        """
        chosen, rejected = self._render(record.chosen), self._render(record.rejected)
        prompt = _prompt_length(chosen, "chosen", record.source)
        if _prompt_length(rejected, "rejected", record.source) != prompt or (
            chosen.input_ids[:prompt] != rejected.input_ids[:prompt]
        ):
            raise DataError(
                record.source,
                "field 'rejected': its rendering differs from the chosen one's before the answer; the two "
                "answers must follow the same prompt tokens",
                "prompt_tokens_differ",
            )
        return self._truncate(chosen, rejected, prompt)

    def _truncate(self, chosen: Sample, rejected: Sample, prompt: int) -> PreferencePair:
        """Cut both answers to one budget and the prompt from its start, so both fit ``max_seq_len``."""
        limit = self.max_seq_len
        longest = max(len(chosen.input_ids), len(rejected.input_ids))
        if longest <= limit:
            return PreferencePair(chosen, rejected, prompt)
        answer_budget = max(limit - prompt, limit // 2)
        answers = [min(len(s.input_ids) - prompt, answer_budget) for s in (chosen, rejected)]
        keep = limit - max(answers)  # the prompt's last ``keep`` tokens
        start = prompt - min(prompt, keep)

        def cut(sample: Sample, answer: int) -> Sample:
            end = prompt + answer
            return Sample(
                sample.input_ids[start:end], sample.labels[start:end], sample.source, len(sample.input_ids)
            )

        return PreferencePair(
            cut(chosen, answers[0]), cut(rejected, answers[1]), prompt - start, truncated=True
        )


class PreferenceCollator:
    """One right-padded batch of ``[chosen rows; rejected rows]`` (``num_pairs`` of each), with the
    SFT collator's counts."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad = PadCollator(pad_id, pad_to_multiple_of)

    def __call__(self, pairs: Sequence[PreferencePair]) -> dict[str, Any]:
        batch = self.pad([p.chosen for p in pairs] + [p.rejected for p in pairs])
        batch["num_pairs"] = len(pairs)
        batch["num_truncated_pairs"] = sum(p.truncated for p in pairs)
        return batch
