"""Unpaired answers labelled desirable or not, read, split, rendered and batched with their KL rows:
the part of an :class:`~lit_instruct.data.datamodule.InstructDataModule` with ``batch_kind: unpaired``
(KTO). Everything but what a record is, how it renders and how answers batch is
:class:`~lit_instruct.data.pair_batches.PairBatches`' (the sources, dedupe, the hold-out of whole
prompts, the refusals). Per split and source, the counts report ``answers``, ``desirable``,
``undesirable``, ``truncated`` (answers cut to ``max_seq_len``) and ``response_tokens``."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from lit_instruct.data.pair_batches import PairBatches, PairStore
from lit_instruct.data.records import DataError, map_columns
from lit_instruct.data.render import Sample
from lit_instruct.data.sources import DataSource, iter_source
from lit_instruct.data.store import SampleStore
from lit_instruct.data.unpaired import (
    UnpairedAnswer,
    UnpairedCollator,
    UnpairedRecord,
    UnpairedRenderer,
    to_unpaired_records,
)
from lit_instruct.data.validation import Rejects
from lit_instruct.errors import ConfigError


class AnswerStore(PairStore):
    """The answers of one split (in ``pairs``, as a pair store keeps its items), with their sources."""

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per answer (its KL row is about as long)."""
        answers: list[Any] = self.pairs
        return np.array([len(a.sample.input_ids) for a in answers], np.int64)

    def samples(self) -> SampleStore:
        """The answers as samples, marked desirable or not (``answers.jsonl:3 desirable``)."""
        answers: list[Any] = self.pairs
        parts = [
            (int(index), [replace(a.sample, source=f"{a.sample.source} {LABELS[a.desirable]}")])
            for index, a in zip(self.source_ids, answers, strict=True)
        ]
        return SampleStore.build(parts, self.names)


LABELS = {True: "desirable", False: "undesirable"}


def _read_answers(source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[UnpairedRecord]:
    """Every answer of ``source`` (bad records raise or are counted, per ``rejects``): in reading
    order, a pair's chosen answer in its place and its rejected one after all of them (TRL's
    ``unpair_preference_dataset`` order), so that neighbours, whose completions the KL rows swap,
    answer different prompts."""
    records, rejected = [], []
    for raw in iter_source(source):
        try:
            if raw.error is not None:
                raise raw.error
            answers = to_unpaired_records(map_columns(raw.value, source.columns, raw.source), raw.source)
        except DataError as error:
            rejects.handle(error, raw.text, counts)
            continue
        for name in answers[0].unused:
            counts[f"unused_field_{name}"] += 1
        records.append(answers[0])
        rejected += answers[1:]  # a pair's rejected answer: after every chosen one, as TRL unpairs
    return records + rejected


class UnpairedBatches(PairBatches):
    """Answers (``prompt``/``completion``/``label``, or pairs unpaired) batched as ``[answers; KL rows]``:
    ``2 * batch_size`` rows (:class:`~lit_instruct.data.unpaired.UnpairedCollator`). Over
    ``max_seq_len`` an answer keeps its start (``on_long_sample``: ``truncate``, ``drop`` or ``raise``).
    ``batch_size`` must be 2 or more (the rules table): the KL rows pair each prompt with another
    answer of its batch."""

    renderer_class = UnpairedRenderer
    store_class = AnswerStore

    def read(self, source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[Any]:
        return _read_answers(source, rejects, counts)

    item_name = "answer"

    def samples_of(self, answer: UnpairedAnswer) -> tuple[Sample, ...]:  # type: ignore[override]
        return (answer.sample,)

    def reject_row(self, record: UnpairedRecord) -> dict[str, str]:  # type: ignore[override]
        return {"answer": str(record.record)}

    def count(self, answer: UnpairedAnswer, counts: Counter[str]) -> None:  # type: ignore[override]
        counts[LABELS[answer.desirable]] += 1

    def count_all(self, answers: list[UnpairedAnswer], counts: Counter[str]) -> None:  # type: ignore[override]
        counts["answers"] += len(answers)
        counts["response_tokens"] += sum(a.sample.num_targets for a in answers)

    def nothing_to_train(self) -> ConfigError | None:
        return None

    def collator(self) -> UnpairedCollator:  # type: ignore[override]
        data = self.data
        tokenizer = data.load_tokenizer()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return UnpairedCollator(pad_id, data.settings.max_seq_len, data.pad_to_multiple_of)
