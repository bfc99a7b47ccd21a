"""Unpaired answers labelled desirable or not (KTO): records, rendered answers and their batches.

The layouts read: TRL's unpaired one, ``prompt`` / ``completion`` / ``label`` (``prompt`` a string, a
user turn, or a list of chat messages; ``completion`` a string or a list holding the one assistant
turn; ``label`` true for a desirable answer, false for an undesirable one; csv's ``true`` / ``false``
text too), and any preference pair (:func:`~lit_instruct.data.preference.to_preference_record`'s
layouts), which gives two answers: the chosen one desirable, the rejected one not (TRL's
``unpair_preference_dataset``). ``system`` and ``tools`` are used as for pairs; other fields counted.

Each answer is rendered as its conversation by the chat template, the last answer labelled (as a
pair's). A batch of ``B`` answers holds ``2B`` rows: the answers, then KTO's KL rows: each answer's
prompt followed by the *previous* answer's completion in the batch (the first takes the last's), as
TRL 1.16's ``KTOTrainer`` pairs them within each batch, cut at ``max_seq_len`` from their end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.preference import (
    FIELDS,
    Part,
    PreferenceRenderer,
    _messages,
    _prompt_length,
    _record,
    _system,
    _turn_names,
    _unused,
    to_preference_record,
)
from lit_instruct.data.records import DataError, Record
from lit_instruct.data.render import Sample
from lit_instruct.labels import IGNORE_INDEX

UNPAIRED_FIELDS = frozenset({"prompt", "completion", "label", "system", "tools"})
"""The fields an unpaired record reads."""


@dataclass(frozen=True)
class UnpairedRecord:
    """One answer's conversation and whether it is desirable; ``unused``: the fields counted unused."""

    record: Record
    desirable: bool
    source: str
    unused: tuple[str, ...] = ()
    turns: tuple[tuple[str, bool], ...] = ()

    @property
    def prompt_key(self) -> tuple[Any, ...]:
        """What the answer follows (the turns before the last, the tools)."""
        return (self.record.messages[:-1], self.record.tools)

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two records the same (duplicates): the conversation and its label."""
        return (self.record.key, self.desirable)


def _label(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise DataError(
        source, f"field 'label' must be true (a desirable answer) or false, got {value!r}", "bad_type"
    )


def to_unpaired_records(raw: Any, source: str) -> list[UnpairedRecord]:
    """The answers of one record: an unpaired one (``label`` given), or a pair's two.

    Raises:
        DataError: for a missing, mistyped or refused field, or a completion that is not one
            assistant turn (a pair: as :func:`~lit_instruct.data.preference.to_preference_record`).
    """
    if isinstance(raw, dict) and "label" not in raw and "chosen" in raw:
        pair = to_preference_record(raw, source)
        return [
            UnpairedRecord(pair.chosen, True, source, pair.unused, pair.turns[0]),
            UnpairedRecord(pair.rejected, False, source, pair.unused, pair.turns[1]),
        ]
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    for field in ("prompt", "completion", "label"):
        if raw.get(field) is None:
            raise DataError(
                source,
                f"field '{field}' is missing (an unpaired answer needs prompt, completion and label; or "
                f"give pairs: prompt, chosen, rejected); the record has {sorted(raw)} (map other names "
                "with columns)",
                "missing_field",
            )
    desirable = _label(raw["label"], source)
    prompt = _messages(raw["prompt"], "prompt", "user", source)
    completion = _messages(raw["completion"], "completion", "assistant", source)
    turn = completion.turns[0]
    if len(completion.turns) != 1 or not isinstance(turn, dict) or turn.get("role") != "assistant":
        raise DataError(source, "field 'completion' must be one assistant turn", "bad_pair")
    parts: list[Part] = [*_system(raw, prompt, source), prompt, completion]
    unused = _unused(raw, [prompt, completion], source, UNPAIRED_FIELDS | (FIELDS - {"chosen", "rejected"}))
    record = _record(parts, raw.get("tools"), source)
    return [UnpairedRecord(record, desirable, source, unused, _turn_names(parts))]


@dataclass(frozen=True)
class UnpairedAnswer:
    """A rendered answer: its sample (labels on the answer only), its prompt's tokens and label;
    ``truncated`` when it was cut to ``max_seq_len``."""

    sample: Sample
    prompt_length: int
    desirable: bool
    truncated: bool = False

    def without_labels(self) -> UnpairedAnswer:
        """The answer as a rank's padding repeat: nothing in it counts."""
        labels = [IGNORE_INDEX] * len(self.sample.labels)
        return replace(self, sample=replace(self.sample, labels=labels), truncated=False)


class UnpairedRenderer:
    """Render unpaired records with a pair renderer's chat rendering (the last answer labelled);
    over ``max_seq_len`` an answer keeps its start and loses its end (TRL's ``KTOTrainer`` cut), and
    one whose prompt alone fills ``max_seq_len`` is refused (``prompt_too_long``)."""

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template: str | None = None) -> None:
        self.pairs = PreferenceRenderer(tokenizer, max_seq_len, chat_template)
        self.renderer = self.pairs.renderer
        self.max_seq_len = max_seq_len

    def __call__(self, record: UnpairedRecord) -> UnpairedAnswer:
        sample = self.pairs._render(record.record, record.turns)
        prompt = _prompt_length(sample, "completion", record.source)
        limit = self.max_seq_len
        if prompt >= limit:
            raise DataError(
                record.source,
                f"the prompt has {prompt} tokens, max_seq_len={limit} leaves none for the answer",
                "prompt_too_long",
            )
        if len(sample.input_ids) <= limit:
            return UnpairedAnswer(sample, prompt, record.desirable)
        cut = Sample(sample.input_ids[:limit], sample.labels[:limit], sample.source, len(sample.input_ids))
        return UnpairedAnswer(cut, prompt, record.desirable, truncated=True)


def kl_sample(answer: UnpairedAnswer, other: UnpairedAnswer, max_seq_len: int) -> Sample:
    """``answer``'s prompt followed by ``other``'s completion (labelled), cut at ``max_seq_len``."""
    prompt = answer.sample.input_ids[: answer.prompt_length]
    ids = prompt + other.sample.input_ids[other.prompt_length :]
    labels = [IGNORE_INDEX] * len(prompt) + other.sample.labels[other.prompt_length :]
    return Sample(ids[:max_seq_len], labels[:max_seq_len], answer.sample.source, len(ids))


class UnpairedCollator:
    """One right-padded batch of ``[answer rows; KL rows]`` (``B`` of each: answer ``i``'s prompt with
    answer ``i - 1``'s completion), with ``desirable`` (``(B,)`` bool), ``answer_mask`` (the answers
    that count, not a rank's padding repeats) and ``num_counted_answers``."""

    def __init__(self, pad_id: int, max_seq_len: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad = PadCollator(pad_id, pad_to_multiple_of)
        self.max_seq_len = max_seq_len

    def __call__(self, answers: Sequence[UnpairedAnswer]) -> dict[str, Any]:
        shifted = [answers[-1], *answers[:-1]]
        kl = [kl_sample(a, b, self.max_seq_len) for a, b in zip(answers, shifted, strict=True)]
        batch = self.pad([a.sample for a in answers] + kl)
        n = len(answers)
        mask = (batch["labels"][:n, 1:] != IGNORE_INDEX).any(dim=1)
        batch["desirable"] = torch.tensor([a.desirable for a in answers], dtype=torch.bool)
        batch["answer_mask"] = mask
        # a KL row counts when its own prompt's answer counts and it holds a completion of another
        # answer (not a padding repeat's, nor its own in a batch of one)
        batch["kl_mask"] = mask & (batch["labels"][n:, 1:] != IGNORE_INDEX).any(dim=1) & (n > 1)
        batch["num_counted_answers"] = int(mask.sum())
        # the collator's counts are of the answer rows only (the KL rows are scored without gradient)
        batch["num_response_tokens"] = int((batch["labels"][: len(answers), 1:] != IGNORE_INDEX).sum())
        batch["num_tokens"] = int(batch["attention_mask"][: len(answers)].sum())
        return batch
