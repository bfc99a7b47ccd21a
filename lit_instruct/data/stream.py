"""Streaming training data: records read, shuffled in a buffer and rendered while training runs.

For corpora that do not fit on disk as a tokenized copy, or in memory. Each rank reads the sources
in order and keeps every ``world_size``-th record (so ranks never share one), shuffles them in a
seeded buffer, and renders each as it leaves the buffer. The stream never ends: after the last record
the next data epoch starts (a new buffer seed), so every rank always has a batch and training is
bounded by ``max_steps``.

Every sample carries its position ``(epoch, record, sample)``: the data epoch, how many records had
left this rank's buffer before its record, and its index among that record's samples (a record can
give several, one per assistant turn). Resuming from a position re-reads and re-shuffles the records
before it without rendering them, so the resumed stream is exactly the uninterrupted one.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from lit_instruct.data.records import DataError, Record
from lit_instruct.data.render import Sample
from lit_instruct.data.sources import DataSource, count_unused, iter_source, parse
from lit_instruct.data.tokenize import TokenizeSettings
from lit_instruct.data.validation import Rejects, build_samples

Position = tuple[int, int, int]  # (data epoch, records before this one, sample within the record)
START: Position = (0, 0, -1)  # before the first sample


class SampleStream(IterableDataset):
    """Samples of ``sources`` for one rank, each with its :data:`Position`.

    Args:
        sources: read in this order (weights are not supported: there are no sizes to weigh).
        settings: a renderer per source and the bad-record / long-sample policies.
        rank: this rank.
        world_size: number of ranks.
        seed: seed of the shuffle buffer (with the epoch and the rank).
        shuffle_buffer: records in the buffer; 1 keeps the reading order.
        resume: start after this position (``(epoch, records, samples)`` of the last sample trained on).
    """

    def __init__(
        self,
        sources: Sequence[DataSource],
        settings: TokenizeSettings,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        resume: Position | None = None,
    ) -> None:
        if any(s.weight != 1.0 for s in sources):
            raise ValueError("streaming reads its sources in order: weights need data.streaming: false")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.sources = list(sources)
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.resume = resume
        self.counts: Counter[str] = Counter()
        self.rejects = Rejects(settings.on_bad_record)

    def records(self, epoch: int) -> Iterator[tuple[int, Record]]:
        """This rank's share of every source's records, with the index of their source; bad ones
        are raised or counted and kept (in the first data epoch only: later ones read them again)."""
        index = 0
        for number, source in enumerate(self.sources):
            for raw in iter_source(source, streaming=True):
                index += 1
                if (index - 1) % self.world_size != self.rank:
                    continue
                try:
                    record = parse(raw, source)
                except DataError as error:
                    if epoch == 0:
                        self.rejects.handle(error, raw.text, self.counts)
                    continue
                if epoch == 0:
                    count_unused(record, self.counts)
                yield number, record

    def shuffled(self, epoch: int) -> Iterator[tuple[int, Record]]:
        """The records through a seeded buffer: each leaving one is drawn from the buffer at random."""
        rng = random.Random(f"{self.seed}/{epoch}/{self.rank}")  # str seeds: the same in every process
        buffer: list[tuple[int, Record]] = []
        for item in self.records(epoch):
            if len(buffer) < self.shuffle_buffer:
                buffer.append(item)
                continue
            k = rng.randrange(len(buffer))
            buffer[k], item = item, buffer[k]
            yield item
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[tuple[Sample, Position]]:
        epoch, skip_records, skip_samples = self.resume or START
        while True:
            produced = False
            for k, (source, record) in enumerate(self.shuffled(epoch)):
                if k < skip_records:
                    continue  # before the resume point: read and shuffled, not rendered
                counts: Counter[str] = Counter()
                renderer = self.settings.renderers[source]
                settings = self.settings
                rejects = self.rejects if epoch == 0 else Rejects("skip")  # kept once, not per epoch
                samples = build_samples(
                    [record], renderer, counts, rejects, settings.on_long_sample, settings.vocab_size
                )
                self.counts.update(counts)
                for j, sample in enumerate(samples):
                    if k == skip_records and j <= skip_samples:
                        continue
                    produced = True
                    yield sample, (epoch, k, j)
            if not produced and skip_records == 0:
                raise ValueError(
                    f"the training stream has no sample with a response token: {dict(self.counts)}"
                )
            epoch, skip_records, skip_samples = epoch + 1, 0, -1


class StreamCollator:
    """Batches ``(sample, position)`` pairs with ``collate`` and adds ``stream_position``: the
    position of the batch's last sample."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: Sequence[tuple[Sample, Position]]) -> dict[str, Any]:
        batch = self.collate([sample for sample, _ in items])
        batch["stream_position"] = items[-1][1]
        return batch
