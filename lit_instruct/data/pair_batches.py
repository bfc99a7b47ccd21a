"""Preference pairs read, split, rendered and batched as ``[chosen; rejected]``: the part of an
:class:`~lit_instruct.data.datamodule.InstructDataModule` with ``batch_kind: pairs``.

The sources, the split, the tokenizer, the new tokens, the training order and its resume are the
data module's; what differs is what a record is (a
:class:`~lit_instruct.data.preference.PreferenceRecord`: TRL's layouts and UltraFeedback's), how it
renders (a :class:`~lit_instruct.data.preference.PreferencePair` sharing its prompt's tokens, both answers cut
alike) and how pairs batch (:class:`PairCollator`). The held-out pairs are whole prompts: pairs
that answer the same prompt (the same turns before their answers) are all trained on or all held
out, so validation never scores a prompt the policy was trained on. Per split and source, the counts
report ``pairs``, ``truncated`` (pairs cut to ``max_seq_len``), ``response_tokens`` (both answers'
labelled tokens), ``tied_scores``, ``unused_field_<name>``, duplicates, drops and skips, as for SFT data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lit_instruct.data.even_shards import EvenShards
from lit_instruct.data.loader_workers import ignore_stop_signals
from lit_instruct.data.nothing_to_train import ANSWERS_CUT_SHORT, MIN_CUT_ANSWER_TOKENS, pairs_cut_short
from lit_instruct.data.preference import (
    PreferenceCollator,
    PreferencePair,
    PreferenceRecord,
    PreferenceRenderer,
    to_preference_record,
)
from lit_instruct.data.prepare import hold_out
from lit_instruct.data.records import DataError, map_columns
from lit_instruct.data.reference_cache import ReferenceFn, compute_reference
from lit_instruct.data.render import Sample
from lit_instruct.data.sources import CHATTERBOT, DataSource, iter_source
from lit_instruct.data.store import SampleStore
from lit_instruct.data.training_feed import PositionKeptLoader
from lit_instruct.data.validation import Rejects, check_vocabulary
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX


class PairStore(Sequence[PreferencePair]):
    """The pairs of one split, with the index of the source each came from (``names`` are the
    sources'); ``lengths`` (both rows' tokens) order the sampler's length grouping."""

    def __init__(self, parts: Sequence[tuple[int, Sequence[PreferencePair]]], names: Sequence[str]) -> None:
        self.pairs = [pair for _, part in parts for pair in part]
        self.reference_key: str | None = None  # whose reference values the pairs carry, if any
        self.names = list(names)
        self.source_ids = np.array([index for index, part in parts for _ in part], dtype=np.int32)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: Any) -> Any:
        return self.pairs[index]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per pair, chosen and rejected rows together."""
        return np.array([len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in self.pairs], np.int64)

    @property
    def offsets(self) -> np.ndarray:
        """Cumulative tokens (``offsets[-1]``: all of them), as a sample store has."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def samples(self) -> SampleStore:
        """The pairs as samples, each pair's chosen then its rejected, their origins marked so
        (``pairs.jsonl:3 chosen``): what ``inspect`` shows."""
        parts = [
            (
                int(index),
                [
                    replace(p.chosen, source=f"{p.chosen.source} chosen"),
                    replace(p.rejected, source=f"{p.rejected.source} rejected"),
                ],
            )
            for index, p in zip(self.source_ids, self.pairs, strict=True)
        ]
        return SampleStore.build(parts, self.names)

    def counts_by_source(self) -> dict[str, int]:
        """Pairs per source name, in source order."""
        counts = np.bincount(self.source_ids, minlength=len(self.names))
        return {name: int(n) for name, n in zip(self.names, counts, strict=True)}


@dataclass
class PreparedPairs:
    """Train and validation pairs, counts per split and source, and the rejected records (what
    :class:`~lit_instruct.data.prepare.PreparedData` holds for samples; pairs are not cached)."""

    train: PairStore
    val: PairStore
    counts: dict[str, dict[str, Counter[str]]]
    rejects: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    folder: Path | None = None

    def totals(self, split: str) -> Counter[str]:
        """The counts of ``split`` summed over sources."""
        return sum(self.counts[split].values(), Counter())


class Uncounted(Dataset):
    """``items`` (pairs, answers), where a marked index (:func:`~lit_instruct.data.even_shards.padding_index`,
    the repeats that even out the ranks) gives its item with no label (``without_labels``): it counts
    as nothing."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        if index >= 0:
            return self.items[index]
        return self.items[-1 - index].without_labels()


class PairCollator(PreferenceCollator):
    """:class:`PreferenceCollator`'s batch, plus ``pair_mask`` (``(P,)`` bool: the pairs that count,
    not a rank's padding repeats) and ``num_counted_pairs``, counted here on the host."""

    def __call__(self, pairs: Sequence[PreferencePair]) -> dict[str, Any]:
        batch = super().__call__(pairs)
        mask = (batch["labels"][: len(pairs), 1:] != IGNORE_INDEX).any(dim=1)
        batch["pair_mask"] = mask
        batch["num_counted_pairs"] = int(mask.sum())
        return batch


def _read_pairs(source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[PreferenceRecord]:
    """Every preference record of ``source`` (bad ones raise or are counted, per ``rejects``)."""
    records = []
    for raw in iter_source(source):
        try:
            if raw.error is not None:
                raise raw.error
            record = to_preference_record(map_columns(raw.value, source.columns, raw.source), raw.source)
        except DataError as error:
            rejects.handle(error, raw.text, counts)
            continue
        for name in record.unused:
            counts[f"unused_field_{name}"] += 1
        if record.tied:
            counts["tied_scores"] += 1
        records.append(record)
    return records


def hold_out_prompts(records: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seeded ``fraction`` of the prompts held out with all their pairs, both parts in reading
    order: :func:`~lit_instruct.data.prepare.hold_out`'s split of the prompts (with one pair per
    prompt, its very split of the records)."""
    groups: dict[Any, int] = {}
    group_of = [groups.setdefault(record.prompt_key, len(groups)) for record in records]
    held_out = set(hold_out(list(range(len(groups))), fraction, seed)[1])
    return (
        [r for r, g in zip(records, group_of, strict=True) if g not in held_out],
        [r for r, g in zip(records, group_of, strict=True) if g in held_out],
    )


def _drop_duplicates(records: list[Any], seen: set[Any], counts: Counter[str]) -> list[Any]:
    """Keep the first of identical records (their ``key``; ``seen`` spans all sources)."""
    unique = []
    for record in records:
        key = record.key
        if key in seen:
            counts["dropped_duplicate"] += 1
            continue
        seen.add(key)
        unique.append(record)
    return unique


class PairBatches:
    """The pairs part of an :class:`~lit_instruct.data.datamodule.InstructDataModule` whose
    ``batch_kind`` is ``pairs``: preference pairs (``prompt``/``chosen``/``rejected``, or
    ``chosen``/``rejected`` conversations sharing all but their last turn) from the data module's
    sources, with its settings. Each micro-batch holds ``batch_size`` pairs: ``2 * batch_size`` rows,
    the chosen then the rejected. Over ``max_seq_len``, a pair's prompt keeps its end and both answers
    are cut alike (``on_long_sample``: ``truncate``, ``drop`` or ``raise``). The settings that do not
    apply to pairs are refused by :data:`lit_instruct.rules.CONFLICTS`; a source's own ``format``
    other than ``auto`` and the chatterbot corpus here. ``num_proc`` is unused: pairs render in the
    main process, uncached.
    """

    renderer_class: Any = PreferenceRenderer
    store_class: Any = PairStore

    def __init__(self, data: Any) -> None:
        self.data = data

    def read(self, source: DataSource, rejects: Rejects, counts: Counter[str]) -> list[Any]:
        """Every record of ``source`` (bad ones raise or are counted, per ``rejects``)."""
        return _read_pairs(source, rejects, counts)

    def _refuse_sources(self) -> None:
        data = self.data
        for source in data.sources + data.val_sources:
            if source.path.startswith(CHATTERBOT):
                raise ConfigError(
                    "data.sources", f"{source.path}: the chatterbot corpus has no preference pairs"
                )
            if source.format != "auto":
                raise ConfigError(
                    "data.format" if data.hparams.get("format") != "auto" else "data.sources",
                    f"{source.path}: format must be auto for preference data (the pair layouts are told "
                    f"apart per record), got {source.format!r}",
                )

    def prepare(self) -> PreparedPairs:
        """Read, split and render the pairs (not cached: render time is small next to a step's)."""
        self._refuse_sources()
        data = self.data
        tokenizer = data.load_tokenizer()
        settings = data.settings
        vocab = data.model_vocab_size()
        counts: dict[str, dict[str, Counter[str]]] = {"train": {}, "val": {}}
        rejects = Rejects(settings.on_bad_record)
        names = [s.name or "" for s in data.sources]
        train = [
            self.read(s, rejects, counts["train"].setdefault(n, Counter()))
            for s, n in zip(data.sources, names, strict=True)
        ]
        if settings.deduplicate:
            seen: set[Any] = set()
            train = [_drop_duplicates(r, seen, counts["train"][n]) for r, n in zip(train, names, strict=True)]
        val_names = [s.name or "" for s in data.val_sources]
        val = [
            self.read(s, rejects, counts["val"].setdefault(n, Counter()))
            for s, n in zip(data.val_sources, val_names, strict=True)
        ]
        val_parts = list(data.val_sources)
        for i, source in enumerate(data.sources):
            fraction = source.val_fraction if source.val_fraction is not None else settings.val_fraction
            if data.val_sources and source.val_fraction is None:
                fraction = 0.0
            train[i], held_out = hold_out_prompts(train[i], fraction, settings.split_seed)
            if held_out:
                name = names[i] if names[i] not in val_names else f"{names[i]}-held-out"
                val.append(held_out)
                val_names.append(name)
                val_parts.append(source)
        renderers: dict[str | None, Any] = {}

        def render(
            split: str,
            sources: list[DataSource],
            records: list[list[Any]],
            split_names: list[str],
        ) -> PairStore:
            parts = []
            for index, (source, part, name) in enumerate(zip(sources, records, split_names, strict=True)):
                template = settings.template_for(source)
                if template not in renderers:
                    renderers[template] = self.renderer_class(tokenizer, settings.max_seq_len, template)
                source_counts = counts[split].setdefault(name, Counter())
                parts.append((index, self._render(part, renderers[template], source_counts, rejects, vocab)))
            return self.store_class(parts, split_names)

        prepared = PreparedPairs(
            render("train", data.sources, train, names),
            render("val", val_parts, val, val_names),
            counts,
            rejects.rows,
        )
        return prepared

    item_name = "pair"
    """What one record renders to, as the ``on_long_sample: raise`` message names it."""

    def _render(
        self, records: list[Any], renderer: Any, counts: Counter[str], rejects: Rejects, vocab: int | None
    ) -> list[Any]:
        """The items (pairs, answers, prompts) of ``records``; long ones truncated (counted), dropped or
        raised as ``on_long_sample`` says, bad ones raised or skipped as ``on_bad_record`` says."""
        policy = self.data.settings.on_long_sample
        items = []
        for record in records:
            try:
                item = renderer(record)
                if vocab is not None:
                    for sample in self.samples_of(item):
                        check_vocabulary(sample, vocab, renderer.renderer.tokenizer)
                if item.truncated and policy == "raise":
                    longest = max(sample.full_length for sample in self.samples_of(item))
                    raise DataError(
                        record.source,
                        f"the {self.item_name} has {longest} tokens, more than "
                        f"max_seq_len={renderer.max_seq_len}",
                        reason="too_long",
                    )
            except DataError as error:
                rejects.handle(error, self.reject_row(record), counts)
                continue
            if item.truncated and policy == "drop":
                counts["dropped_too_long"] += 1
                continue
            counts["truncated"] += item.truncated
            self.count(item, counts)
            items.append(item)
        self.count_all(items, counts)
        return items

    def samples_of(self, pair: PreferencePair) -> tuple[Sample, ...]:
        """The rendered samples of one item (a pair's chosen and rejected)."""
        return pair.chosen, pair.rejected

    def reject_row(self, record: PreferenceRecord) -> dict[str, str]:
        """What the rejects file shows of a bad record."""
        return {"chosen": str(record.chosen), "rejected": str(record.rejected)}

    def count(self, pair: PreferencePair, counts: Counter[str]) -> None:
        """An item's own counts, as it is kept."""
        cut = pair.shortest_cut_answer
        counts[ANSWERS_CUT_SHORT] += cut is not None and cut < MIN_CUT_ANSWER_TOKENS

    def count_all(self, pairs: list[PreferencePair], counts: Counter[str]) -> None:
        """The kept items' totals."""
        counts["pairs"] += len(pairs)
        counts["response_tokens"] += sum(p.chosen.num_targets + p.rejected.num_targets for p in pairs)

    def nothing_to_train(self) -> ConfigError | None:
        """When every training pair's answers were cut to under :data:`MIN_CUT_ANSWER_TOKENS`
        tokens: a preference between answers' first few tokens (no pair at all: the data module's)."""
        data = self.data
        sources = [source.path for source in data.sources]
        return pairs_cut_short(data._prepared().totals("train"), sources, data.settings.max_seq_len)

    def pairs(self, split: str) -> PairStore:
        """The ``train`` or ``val`` pairs (after the data module's ``setup``)."""
        prepared = cast(PreparedPairs, self.data._prepared())
        return prepared.train if split == "train" else prepared.val

    def cache_reference(
        self,
        reference: ReferenceFn,
        key: str,
        splits: Sequence[str] = ("train", "val"),
        world_size: int = 1,
        rank: int = 0,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> int:
        """Compute the reference log-probabilities of every pair of ``splits`` once
        (:func:`~lit_instruct.data.reference_cache.compute_reference`); the batches then carry them.
        ``key`` names the reference (a module's): values kept under another key are computed again,
        so a second model on this data module is never scored against the first one's reference.
        Returns how many pairs were computed (0 when all had this key's values already)."""
        computed = 0
        for split in splits:
            store = self.pairs(split)
            if store.pairs and store.reference_key != key:
                store.pairs[:] = compute_reference(
                    store.pairs,
                    self.collator(),
                    reference,
                    self.data.eval_batch_size,
                    world_size,
                    rank,
                    all_reduce_sum,
                )
                store.reference_key = key
                computed += len(store.pairs)
        return computed

    def collator(self) -> PairCollator:
        tokenizer = self.data.load_tokenizer()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return PairCollator(pad_id, self.data.pad_to_multiple_of)

    def train_dataloader(self, sampler: Any) -> DataLoader:
        """The feed's order (``sampler``: seeded, sharded, resumable) over the pairs, ``batch_size``
        pairs a batch."""
        return PositionKeptLoader(
            Uncounted(self.pairs("train")),
            batch_size=self.data.batch_size,
            sampler=sampler,
            collate_fn=self.collator(),
        )

    def val_dataloader(self) -> DataLoader:
        """All held-out pairs in order, over several ranks each counted once."""
        pairs = self.pairs("val")
        data = self.data
        trainer = data.trainer
        sampler = None
        if trainer is not None and trainer.world_size > 1:
            sampler = EvenShards(pairs, trainer.world_size, trainer.global_rank)
        return DataLoader(
            Uncounted(pairs),  # without padding repeats: the pairs as they are
            batch_size=data.eval_batch_size,
            shuffle=False,
            sampler=sampler,
            collate_fn=self.collator(),
            num_workers=data.num_workers,
            worker_init_fn=ignore_stop_signals,
        )
