"""Render and tokenize records into a :class:`SampleStore`, in several processes if asked.

Records are cut into chunks of :data:`CHUNK` and rendered by ``num_proc`` forked workers, each with
the renderers of the parent; results come back in order, so the store, the counts, the rejects and
the first error raised (with ``on_bad_record: raise``) are those of a single process.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lit_instruct.data.records import Record
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.store import SampleStore
from lit_instruct.data.validation import BadRecordPolicy, LongSamplePolicy, Rejects, build_samples

CHUNK = 512


@dataclass(frozen=True)
class TokenizeSettings:
    """What turns records into samples, besides the records: one renderer per source and the
    policies."""

    renderers: Sequence[ChatRenderer]
    on_bad_record: BadRecordPolicy
    on_long_sample: LongSamplePolicy
    vocab_size: int | None


_SETTINGS: TokenizeSettings | None = None  # the workers' copy, inherited through fork


def _render_chunk(
    job: tuple[int, list[Record]],
) -> tuple[int, SampleStore, Counter[str], list[dict[str, Any]]]:
    source, records = job
    settings = _SETTINGS
    assert settings is not None, "_render_chunk runs in a worker forked by tokenize()"
    counts: Counter[str] = Counter()
    rejects = Rejects(settings.on_bad_record)
    samples = build_samples(
        records, settings.renderers[source], counts, rejects, settings.on_long_sample, settings.vocab_size
    )
    return source, SampleStore.build([(source, samples)], []), counts, rejects.rows  # arrays: cheap to send


def _chunks(records_by_source: Sequence[Sequence[Record]]) -> Iterator[tuple[int, list[Record]]]:
    for source, records in enumerate(records_by_source):
        for start in range(0, len(records), CHUNK):
            yield source, list(records[start : start + CHUNK])


def tokenize(
    records_by_source: Sequence[Sequence[Record]],
    settings: TokenizeSettings,
    names: Sequence[str],
    num_proc: int = 1,
) -> tuple[SampleStore, list[Counter[str]], list[dict[str, Any]]]:
    """Render every source's records with its renderer.

    Returns:
        the store (samples in source order, each source's in record order), the counts of each
        source (``samples``, ``truncated``, ``dropped_*``, ``skipped_*`` ...) and the rejected records.
    """
    global _SETTINGS
    _SETTINGS = settings
    jobs = _chunks(records_by_source)
    counts: list[Counter[str]] = [Counter() for _ in records_by_source]
    rejects: list[dict[str, Any]] = []
    try:
        if num_proc > 1 and "fork" in multiprocessing.get_all_start_methods():
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers encode one text at a time
            with multiprocessing.get_context("fork").Pool(num_proc) as pool:
                results = list(pool.imap(_render_chunk, jobs))
        else:
            results = [_render_chunk(job) for job in jobs]
    finally:
        _SETTINGS = None
    for source, _, chunk_counts, rows in results:
        counts[source].update(chunk_counts)
        rejects += rows
    for source_counts in counts:  # a source with nothing left says so
        source_counts["samples"] += 0
        source_counts["response_tokens"] += 0
    empty = SampleStore.build([], names)
    return SampleStore.concatenate([empty] + [part for _, part, _, _ in results], names), counts, rejects
