"""Tokenized samples in flat arrays, saved as ``.npy`` files and memory-mapped back.

A :class:`SampleStore` holds every sample's token ids and labels end to end (int32), their
boundaries, lengths before truncation, the index of the source each came from, and each sample's
origin (``file:line``) as UTF-8 bytes. Loaded from disk, the arrays are memory-mapped: a corpus of
millions of samples costs no Python objects until a batch asks for its samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from lit_instruct.data.render import Sample

ARRAYS = ("input_ids", "labels", "offsets", "full_lengths", "source_ids", "origins", "origin_offsets")


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
        }
        return cls(arrays, names)

    @classmethod
    def concatenate(cls, stores: Sequence[SampleStore], names: Sequence[str]) -> SampleStore:
        """One store of ``stores`` end to end (their source indices must already agree)."""
        if len(stores) == 1:
            return stores[0]

        def joined(name: str) -> np.ndarray:
            parts = [s.arrays[name] for s in stores]
            if name not in ("offsets", "origin_offsets"):
                return np.concatenate(parts)
            shifts = np.cumsum([0] + [int(p[-1]) for p in parts[:-1]])
            return np.concatenate(
                [parts[0][:1]] + [p[1:] + shift for p, shift in zip(parts, shifts, strict=True)]
            )

        return cls({name: joined(name) for name in ARRAYS}, names)

    def save(self, folder: Path) -> None:
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
        return Sample(
            self.arrays["input_ids"][start:end].tolist(),
            self.arrays["labels"][start:end].tolist(),
            bytes(self.arrays["origins"][o_start:o_end]).decode(),
            int(self.arrays["full_lengths"][index]),
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
