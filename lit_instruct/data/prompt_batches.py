"""Prompts read, split, rendered and batched for online RL: the part of an
:class:`~lit_instruct.data.datamodule.InstructDataModule` with ``batch_kind: prompts`` (GRPO, RLOO).
Everything but what a record is, how it renders and how prompts batch is
:class:`~lit_instruct.data.pair_batches.PairBatches`' (the sources, dedupe, the hold-out of whole
prompts, the refusals). Per split and source, the counts report ``prompts``, ``truncated`` (prompts
that kept their end only) and ``prompt_tokens``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from lit_instruct.data.pair_batches import PairBatches, PairStore
from lit_instruct.data.prompts import Prompt, PromptCollator, PromptRecord, PromptRenderer, to_prompt_record
from lit_instruct.data.records import DataError, map_columns
from lit_instruct.data.render import Sample
from lit_instruct.data.sources import DataSource, iter_source
from lit_instruct.data.store import SampleStore
from lit_instruct.data.validation import Rejects
from lit_instruct.errors import ConfigError


class PromptStore(PairStore):
    """The prompts of one split (in ``pairs``, as a pair store keeps its items), with their sources."""

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per prompt."""
        prompts: list[Any] = self.pairs
        return np.array([len(p.sample.input_ids) for p in prompts], np.int64)

    def samples(self) -> SampleStore:
        """The prompts as samples (nothing labelled): what ``inspect`` shows."""
        prompts: list[Any] = self.pairs
        parts = [(int(index), [p.sample]) for index, p in zip(self.source_ids, prompts, strict=True)]
        return SampleStore.build(parts, self.names)


def _read_prompts(source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[PromptRecord]:
    """Every prompt of ``source``, in reading order (bad records raise or are counted, per ``rejects``)."""
    records = []
    for raw in iter_source(source):
        try:
            if raw.error is not None:
                raise raw.error
            records.append(to_prompt_record(map_columns(raw.value, source.columns, raw.source), raw.source))
        except DataError as error:
            rejects.handle(error, raw.text, counts)
    return records


class PromptBatches(PairBatches):
    """Prompts (``prompt`` and the rewards' columns) batched as lists, ``batch_size`` prompts each
    (:class:`~lit_instruct.data.prompts.PromptCollator`); the objective samples their completions.
    Over ``max_seq_len`` a prompt keeps its end (``on_long_sample``: ``truncate``, ``drop`` or
    ``raise``)."""

    renderer_class = PromptRenderer
    store_class = PromptStore

    def read(self, source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[Any]:
        return _read_prompts(source, rejects, counts)

    item_name = "prompt"

    def samples_of(self, prompt: Prompt) -> tuple[Sample, ...]:  # type: ignore[override]
        return (prompt.sample,)

    def reject_row(self, record: PromptRecord) -> dict[str, str]:  # type: ignore[override]
        return {"prompt": str(record.record)}

    def count(self, prompt: Prompt, counts: Counter[str]) -> None:  # type: ignore[override]
        """Nothing of its own."""

    def count_all(self, prompts: list[Prompt], counts: Counter[str]) -> None:  # type: ignore[override]
        counts["prompts"] += len(prompts)
        counts["prompt_tokens"] += sum(len(p.sample.input_ids) for p in prompts)

    def nothing_to_train(self) -> ConfigError | None:
        return None

    def collator(self) -> PromptCollator:  # type: ignore[override]
        return PromptCollator()
