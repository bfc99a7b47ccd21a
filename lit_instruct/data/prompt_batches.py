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
from lit_instruct.data.sources import DataSource, iter_source
from lit_instruct.data.store import SampleStore
from lit_instruct.data.validation import Rejects, check_vocabulary
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

    def _render(  # type: ignore[override]
        self,
        records: list[PromptRecord],
        renderer: PromptRenderer,
        counts: Counter[str],
        rejects: Rejects,
        vocab: int | None,
    ) -> list[Prompt]:
        policy = self.data.settings.on_long_sample
        prompts = []
        for record in records:
            try:
                prompt = renderer(record)
                if vocab is not None:
                    check_vocabulary(prompt.sample, vocab, renderer.renderer.tokenizer)
                if prompt.truncated and policy == "raise":
                    raise DataError(
                        record.source,
                        f"the prompt has {prompt.sample.full_length} tokens, more than "
                        f"max_seq_len={renderer.max_seq_len}",
                        reason="too_long",
                    )
            except DataError as error:
                rejects.handle(error, {"prompt": str(record.record)}, counts)
                continue
            if prompt.truncated and policy == "drop":
                counts["dropped_too_long"] += 1
                continue
            counts["truncated"] += prompt.truncated
            prompts.append(prompt)
        counts["prompts"] += len(prompts)
        counts["prompt_tokens"] += sum(len(p.sample.input_ids) for p in prompts)
        return prompts

    def nothing_to_train(self) -> ConfigError | None:
        return None

    def collator(self) -> PromptCollator:  # type: ignore[override]
        return PromptCollator()
