"""Tokenized samples in flat arrays, saved as ``.npy`` files and memory-mapped back.

A :class:`SampleStore` holds every sample's token ids and labels end to end (int32), their
boundaries, lengths before truncation, the index of the source each came from, each sample's
origin (``file:line``) and the references of the images it shows (JSON) as UTF-8 bytes. Loaded
from disk, the arrays are memory-mapped: a corpus of millions of samples costs no Python objects
until a batch asks for its samples.

Saved files are checked when opened: :func:`file_checksums` lists each file's size and CRC-32 when
it is written, :func:`check_files` refuses a file that is missing, of another size or whose bytes
changed (:class:`StoreDamaged`, naming it). CRC-32 reads at memory speed (``benchmarks/data_setup.py``
times it), so every byte is checked: a flipped byte is found, not only a cut file.
"""

from __future__ import annotations

import json
import mmap
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from lit_instruct.data.render import Sample

ARRAYS = (
    "input_ids",
    "labels",
    "offsets",
    "full_lengths",
    "source_ids",
    "origins",
    "origin_offsets",
    "images",
    "image_offsets",
)


class StoreDamaged(OSError):
    """A saved file that is not as it was written: ``path`` and why."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def crc32_of(path: Path) -> int:
    """The CRC-32 of a file's bytes (memory-mapped: read once, at memory speed)."""
    with path.open("rb") as handle:
        if not path.stat().st_size:
            return zlib.crc32(b"")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return zlib.crc32(view)


def file_checksums(folder: Path) -> dict[str, list[int]]:
    """Every file under ``folder`` (its path relative to it) -> its size and CRC-32."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, crc32_of(p)] for p in files}


def check_files(folder: Path, listed: dict[str, list[int]]) -> None:
    """Each file :func:`file_checksums` listed is there, of its size, with its CRC-32 (sizes first:
    a missing or cut file is found before any byte is read).

    Raises:
        StoreDamaged: naming the first file that differs.
    """
    for name, (size, _) in listed.items():
        path = folder / name
        if not path.is_file():
            raise StoreDamaged(path, "missing")
        if path.stat().st_size != size:
            raise StoreDamaged(path, f"{path.stat().st_size} bytes, {size} were written")
    for name, (_, crc) in listed.items():
        if crc32_of(folder / name) != crc:
            raise StoreDamaged(folder / name, "its bytes changed since it was written (CRC-32 differs)")


class SampleStore(Sequence[Sample]):
    """Samples of one split, indexable like a list of :class:`Sample`.

    Args:
        arrays: the arrays named in :data:`ARRAYS`.
        names: the source names that ``source_ids`` index.
    """

    def __init__(self, arrays: dict[str, np.ndarray], names: Sequence[str]) -> None:
        self.arrays = arrays
        self.names = list(names)
        self.offsets = arrays["offsets"]
        self.source_ids = arrays["source_ids"]

    @classmethod
    def build(cls, parts: Sequence[tuple[int, Sequence[Sample]]], names: Sequence[str]) -> SampleStore:
        """A store of ``(source index, samples)`` parts, in order."""
        samples = [(index, s) for index, part in parts for s in part]
        lengths = np.array([len(s.input_ids) for _, s in samples], dtype=np.int64)
        origins = [s.source.encode() for _, s in samples]
        images = [json.dumps(list(s.images)).encode() if s.images else b"" for _, s in samples]
        arrays: dict[str, np.ndarray] = {
            "input_ids": np.fromiter(
                (t for _, s in samples for t in s.input_ids), np.int32, int(lengths.sum())
            ),
            "labels": np.fromiter((t for _, s in samples for t in s.labels), np.int32, int(lengths.sum())),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "full_lengths": np.array([s.full_length for _, s in samples], dtype=np.int64),
            "source_ids": np.array([index for index, _ in samples], dtype=np.int32),
            "origins": np.frombuffer(b"".join(origins), dtype=np.uint8),
            "origin_offsets": np.concatenate([[0], np.cumsum([len(o) for o in origins])]).astype(np.int64),
            "images": np.frombuffer(b"".join(images), dtype=np.uint8),
            "image_offsets": np.concatenate([[0], np.cumsum([len(i) for i in images])]).astype(np.int64),
        }
        return cls(arrays, names)

    @classmethod
    def concatenate(cls, stores: Sequence[SampleStore], names: Sequence[str]) -> SampleStore:
        """One store of ``stores`` end to end (their source indices must already agree)."""
        if len(stores) == 1:
            return stores[0]

        def joined(name: str) -> np.ndarray:
            parts = [s.arrays[name] for s in stores]
            if name not in ("offsets", "origin_offsets", "image_offsets"):
                return np.concatenate(parts)
            shifts = np.cumsum([0] + [int(p[-1]) for p in parts[:-1]])
            return np.concatenate(
                [parts[0][:1]] + [p[1:] + shift for p, shift in zip(parts, shifts, strict=True)]
            )

        return cls({name: joined(name) for name in ARRAYS}, names)

    def save(self, folder: Path) -> None:
        """The arrays as ``.npy`` files and the source names in ``folder`` (checked when opened
        through :func:`file_checksums`, by whoever writes the folder)."""
        folder.mkdir(parents=True, exist_ok=True)
        for name in ARRAYS:
            np.save(folder / f"{name}.npy", self.arrays[name])
        (folder / "names.json").write_text(json.dumps(self.names))

    @classmethod
    def load(cls, folder: Path) -> SampleStore:
        """The store saved in ``folder``, memory-mapped."""
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
        return cls(arrays, json.loads((folder / "names.json").read_text()))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> Sample: ...
    @overload
    def __getitem__(self, index: slice) -> list[Sample]: ...
    def __getitem__(self, index: int | slice) -> Sample | list[Sample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        o_start, o_end = (int(x) for x in self.arrays["origin_offsets"][index : index + 2])
        i_start, i_end = (int(x) for x in self.arrays["image_offsets"][index : index + 2])
        images = json.loads(bytes(self.arrays["images"][i_start:i_end])) if i_end > i_start else []
        return Sample(
            self.arrays["input_ids"][start:end].tolist(),
            self.arrays["labels"][start:end].tolist(),
            bytes(self.arrays["origins"][o_start:o_end]).decode(),
            int(self.arrays["full_lengths"][index]),
            tuple(images),
        )

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample."""
        return np.diff(self.offsets)

    def indices_of(self, source: int) -> list[int]:
        """Positions of the samples of source ``source``."""
        return np.flatnonzero(np.asarray(self.source_ids) == source).tolist()

    def counts_by_source(self) -> dict[str, int]:
        """Samples per source name, in source order."""
        counts = np.bincount(np.asarray(self.source_ids), minlength=len(self.names))
        return {name: int(n) for name, n in zip(self.names, counts, strict=True)}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())

    def describe(self) -> dict[str, Any]:
        return {"samples": len(self), "tokens": int(self.offsets[-1]), "bytes": self.nbytes}
