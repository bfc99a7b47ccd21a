"""Sources -> tokenized train and validation stores, cached on disk.

The steps: read each source (bad records raise or are counted and kept for the rejects file), drop
repeated conversations across all sources (before any split, so nothing held out is also trained
on), hold out each source's ``val_fraction`` (seeded, independent of the training seed) unless
validation sources are given, then render and tokenize (:mod:`lit_instruct.data.tokenize`).

The result is cached in ``<cache_dir>/<key>/`` where the key digests the sources' contents and
settings, the tokenizer, every chat template and the data settings: a second run with the same
inputs memory-maps the stores instead of reading and tokenizing again. ``meta.json`` lists every
file's size and CRC-32 and carries its own; a cache folder that differs (a flipped byte, a cut or
missing file) is set aside and rebuilt, with one log line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import warnings
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lit_instruct.data.records import Record
from lit_instruct.data.render import ChatRenderer, MultiTurn, TrainOn
from lit_instruct.data.sources import DataSource, fingerprint, read_source
from lit_instruct.data.store import SampleStore, StoreDamaged, check_files, file_checksums
from lit_instruct.data.tokenize import TokenizeSettings, tokenize
from lit_instruct.data.validation import BadRecordPolicy, LongSamplePolicy, Rejects
from lit_instruct.data.vision_render import VisionRenderer

CACHE_FORMAT = 3  # bump when what a cached store holds, or how it is made, changes
logger = logging.getLogger("lit_instruct")


@dataclass(frozen=True)
class DataSettings:
    """Everything besides the sources and the tokenizer that decides the samples."""

    max_seq_len: int = 512
    multi_turn: MultiTurn = "auto"
    train_on: TrainOn = "answers"
    chat_template: str | None = None
    val_fraction: float = 0.05
    split_seed: int = 1234
    deduplicate: bool = True
    on_bad_record: BadRecordPolicy = "raise"
    on_long_sample: LongSamplePolicy = "truncate"

    def template_for(self, source: DataSource) -> str | None:
        """The chat template override ``source`` is rendered with: its own, else these settings'."""
        return source.chat_template or self.chat_template


@dataclass
class PreparedData:
    """Train and validation stores, counts per split and source, rejected records, and whether it
    came from the cache."""

    train: SampleStore
    val: SampleStore
    counts: dict[str, dict[str, Counter[str]]]
    rejects: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    folder: Path | None = None  # where they are cached

    def totals(self, split: str) -> Counter[str]:
        """The counts of ``split`` summed over sources."""
        return sum(self.counts[split].values(), Counter())


class TemplateRenderers:
    """One :class:`ChatRenderer` per distinct chat template (a source's own, else the settings');
    with a vision-language model's ``processor``, a :class:`VisionRenderer`."""

    def __init__(self, tokenizer: Any, settings: DataSettings, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.data = settings
        self.renderers: dict[str | None, ChatRenderer] = {}

    def __call__(self, source: DataSource) -> ChatRenderer:
        template = self.data.template_for(source)
        if template not in self.renderers:
            settings = (self.data.max_seq_len, template, self.data.multi_turn, self.data.train_on)
            self.renderers[template] = (
                VisionRenderer(self.processor, *settings)
                if self.processor is not None
                else ChatRenderer(self.tokenizer, *settings)
            )
        return self.renderers[template]

    def settings(self, sources: Sequence[DataSource], vocab_size: int | None) -> TokenizeSettings:
        """What :func:`tokenize` (or a stream) needs to render ``sources``."""
        renderers = [self(source) for source in sources]
        return TokenizeSettings(renderers, self.data.on_bad_record, self.data.on_long_sample, vocab_size)


def image_processing_key(processor: Any) -> str | None:
    """What of a vision-language model's processor decides its samples (its image processor's
    settings, its chat template), as text for the cache key."""
    if processor is None:
        return None
    settings = processor.to_json_string()  # the processor's own (image_seq_len, patch_size...) too
    return (
        settings + processor.image_processor.to_json_string() + str(getattr(processor, "chat_template", None))
    )


def drop_duplicates(records: list[Record], seen: set[Any], counts: Counter[str]) -> list[Record]:
    """Keep the first of identical conversations (``seen`` spans all sources)."""
    unique = []
    for record in records:
        if record.key in seen:
            counts["dropped_duplicate"] += 1
            continue
        seen.add(record.key)
        unique.append(record)
    return unique


Item = TypeVar("Item")


def hold_out(records: list[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """A seeded ``fraction`` of ``records`` held out, both parts in reading order."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held_out = set(order[: round(len(records) * fraction)])
    return [r for i, r in enumerate(records) if i not in held_out], [records[i] for i in sorted(held_out)]


def cache_key(
    train: Sequence[DataSource],
    val: Sequence[DataSource],
    tokenizer: Any,
    settings: DataSettings,
    vocab: int | None,
    processor: Any = None,
) -> str:
    """A digest of every input of :func:`prepare`; weights are left out (they do not change samples)."""

    def described(source: DataSource) -> dict[str, Any]:
        return {**asdict(source), "weight": None, "contents": fingerprint(source)}

    backend = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else ""
    inputs = {
        "format": CACHE_FORMAT,
        "train": [described(s) for s in train],
        "val": [described(s) for s in val],
        "tokenizer": hashlib.sha256(backend.encode()).hexdigest(),
        "special_tokens": str(tokenizer.special_tokens_map),
        "tokenizer_template": tokenizer.chat_template,
        "settings": asdict(settings),
        "vocab_size": vocab,
        "processor": image_processing_key(processor),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _count_overlap(
    train: list[list[Record]], val: list[list[Record]], names: list[str], counts: dict[str, Counter[str]]
) -> None:
    """Count (``also_in_training``) and warn about validation conversations that are trained on."""
    trained = {record.key for records in train for record in records}
    for records, name in zip(val, names, strict=True):
        shared = sum(record.key in trained for record in records)
        if shared:
            counts[name]["also_in_training"] += shared
            warnings.warn(
                f"validation source {name!r}: {shared} of its {len(records)} conversations are also in "
                "the training data, so val/loss measures them after training on them",
                stacklevel=3,
            )


def _read(
    sources: Sequence[DataSource], split: str, rejects: Rejects, counts: dict[str, dict[str, Counter[str]]]
) -> list[list[Record]]:
    result = []
    for source in sources:
        assert source.name is not None  # set in DataSource.__post_init__
        source_counts = counts[split].setdefault(source.name, Counter())
        result.append(read_source(source, rejects.on_bad_raw(source_counts), source_counts))
    return result


def prepare(
    train_sources: Sequence[DataSource],
    val_sources: Sequence[DataSource],
    tokenizer: Any,
    settings: DataSettings,
    vocab_size: int | None = None,
    num_proc: int = 1,
    cache_dir: Path | None = None,
    processor: Any = None,
) -> PreparedData:
    """The tokenized train and validation stores of the sources (from ``cache_dir`` if there).

    Train sources hold out their ``val_fraction`` (else ``settings.val_fraction``) only when there
    are no ``val_sources``, or when they set it themselves.
    """
    names = [s.name or "" for s in train_sources]
    val_names = [s.name or "" for s in val_sources]
    for kind, listed in (("training", names), ("validation", val_names)):
        repeated = sorted({n for n in listed if listed.count(n) > 1})
        if repeated:
            raise ValueError(f"several {kind} sources are named {repeated}: give each a distinct name")
    folder = None
    if cache_dir is not None:
        folder = cache_dir / cache_key(train_sources, val_sources, tokenizer, settings, vocab_size, processor)
        if folder.exists():
            try:
                return _load(folder)
            except StoreDamaged as damage:
                logger.warning(f"lit-instruct data: the cache is damaged ({damage}): rebuilding it")
                _set_aside(folder)
    counts: dict[str, dict[str, Counter[str]]] = {"train": {}, "val": {}}
    rejects = Rejects(settings.on_bad_record)
    train_records = _read(train_sources, "train", rejects, counts)
    if settings.deduplicate:
        seen: set[Any] = set()
        train_records = [
            drop_duplicates(records, seen, counts["train"][name])
            for records, name in zip(train_records, names, strict=True)
        ]
    val_records = _read(val_sources, "val", rejects, counts)
    _count_overlap(train_records, val_records, val_names, counts["val"])
    held_out = []
    for i, source in enumerate(train_sources):
        fraction = source.val_fraction if source.val_fraction is not None else settings.val_fraction
        if val_sources and source.val_fraction is None:
            fraction = 0.0
        train_records[i], kept_out = hold_out(train_records[i], fraction, settings.split_seed)
        held_out.append(kept_out)
    val_parts = list(val_sources)  # the source each validation part is rendered as
    if not val_sources:  # held-out parts are the validation sources, under the same names
        val_records, val_names, val_parts = held_out, names, list(train_sources)
    for source, records in zip(train_sources, held_out, strict=True):
        if val_sources and records:  # a source's own held-out part next to the validation files
            name = source.name or ""
            val_records.append(records)
            val_names.append(name if name not in val_names else f"{name}-held-out")
            val_parts.append(source)
    templates = TemplateRenderers(tokenizer, settings, processor)
    train_settings = templates.settings(train_sources, vocab_size)
    train, train_counts, train_rejects = tokenize(train_records, train_settings, names, num_proc)
    val_settings = templates.settings(val_parts, vocab_size)
    val, val_counts, val_rejects = tokenize(val_records, val_settings, val_names, num_proc)
    for split, names_, split_counts in (("train", names, train_counts), ("val", val_names, val_counts)):
        for name, source_counts in zip(names_, split_counts, strict=True):
            counts[split].setdefault(name, Counter()).update(source_counts)
    prepared = PreparedData(train, val, counts, rejects.rows + train_rejects + val_rejects, folder=folder)
    if folder is not None:
        _save(prepared, folder)
    return prepared


def _meta_checksum(meta: dict[str, Any]) -> int:
    """The CRC-32 of ``meta`` (its ``crc32`` left out) as canonical JSON."""
    body = {key: value for key, value in meta.items() if key != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, ensure_ascii=False).encode())


def _save(prepared: PreparedData, folder: Path) -> None:
    """Write the stores, then ``meta.json`` (counts, rejects, every file's size and CRC-32, its own
    CRC-32), as one folder that appears whole."""
    from lit_instruct.io import atomic_directory

    with atomic_directory(folder, replace=False) as staging:  # another rank or node may be first
        prepared.train.save(staging / "train")
        prepared.val.save(staging / "val")
        meta: dict[str, Any] = {
            "counts": prepared.counts,
            "rejects": prepared.rejects,
            "files": file_checksums(staging),
            "images": image_files(prepared),
        }
        meta["crc32"] = _meta_checksum(meta)
        (staging / "meta.json").write_text(json.dumps(meta, ensure_ascii=False))


def _image_stat(path: Path) -> list[int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def image_files(prepared: PreparedData) -> dict[str, list[int] | None]:
    """Each image file the samples show -> its size and modification time (the images decide the
    samples' tokens, yet live outside the data files the cache key reads)."""
    files: set[str] = set()
    for store in (prepared.train, prepared.val):
        if not len(store.arrays["images"]):  # text only: no sample is read
            continue
        for sample in store:
            files.update(ref for ref in sample.images if not ref.startswith("data:"))
    return {name: _image_stat(Path(name)) for name in sorted(files)}


def _read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json``, checked against its own CRC-32.

    Raises:
        StoreDamaged: when it is missing, unreadable or changed.
    """
    path = folder / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise StoreDamaged(path, "missing") from error
    except (OSError, ValueError) as error:
        raise StoreDamaged(path, f"unreadable ({error})") from error
    if not isinstance(meta, dict) or meta.get("crc32") != _meta_checksum(meta):
        raise StoreDamaged(path, "its contents changed since it was written (CRC-32 differs)")
    return meta


def _load(folder: Path) -> PreparedData:
    """The cached stores, memory-mapped once every file is checked.

    Raises:
        StoreDamaged: naming the first file that is not as written.
    """
    meta = _read_meta(folder)
    check_files(folder, meta["files"])
    for name, stat in meta.get("images", {}).items():
        if _image_stat(Path(name)) != stat:
            raise StoreDamaged(Path(name), "an image the samples show changed since they were cached")
    counts = {
        split: {name: Counter(c) for name, c in by_source.items()}
        for split, by_source in meta["counts"].items()
    }
    try:
        train, val = SampleStore.load(folder / "train"), SampleStore.load(folder / "val")
    except (OSError, ValueError) as error:  # set aside by another process while being read
        raise StoreDamaged(folder, f"unreadable ({error})") from error
    return PreparedData(train, val, counts, meta["rejects"], cached=True, folder=folder)


def _set_aside(folder: Path) -> None:
    """Move a damaged cache folder out of the way (one rename: processes that found it damaged at
    once set it aside once) and delete it; maps of its files stay valid until closed."""
    from lit_instruct.io import staging_prefix

    aside = folder.with_name(f"{staging_prefix(folder)}{os.getpid()}-damaged")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        folder.rename(aside)
    except OSError:  # gone already (another process set it aside), or not ours to move
        return
    shutil.rmtree(aside, ignore_errors=True)
