"""Length-grouped sampling: batches of similar lengths, so little of each batch is padding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class LengthGroupedSampler(Sampler[int]):
    """Shuffle, then sort by length within mega-batches of ``batch_size * group_size`` samples.

    Consecutive runs of ``batch_size`` indices have similar lengths; the order of those runs is
    shuffled again so long and short batches alternate. The order depends only on ``seed`` and the
    epoch (Lightning calls :meth:`set_epoch`).

    Args:
        lengths: length of each sample.
        batch_size: the DataLoader's batch size.
        group_size: how many batches' worth of samples are sorted together.
        seed: base seed of the shuffles.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, group_size: int = 32, seed: int = 0) -> None:
        if batch_size < 1 or group_size < 1:
            raise ValueError(f"batch_size and group_size must be >= 1, got {batch_size}, {group_size}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        span = self.batch_size * self.group_size
        batches: list[list[int]] = []
        for start in range(0, len(order), span):
            group = sorted(order[start : start + span], key=lambda i: -self.lengths[i])
            batches += [group[i : i + self.batch_size] for i in range(0, len(group), self.batch_size)]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            yield from batches[b]
