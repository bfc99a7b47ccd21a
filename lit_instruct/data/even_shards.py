"""Several ranks, each sample counted once: every rank runs as many batches (FSDP and DDP forwards
are collective), and the repeats that even out the ranks' shares count no token.

A plain ``DistributedSampler`` pads the order by repeating its start, and those repeats were counted
in ``val/loss`` (9 conversations on 2 ranks gave the loss of 10) and trained twice in an epoch's last
uneven global batch. Here a repeat is handed out as a marked index (:func:`padding_index`, used by
:class:`EvenShards` for validation and :class:`~lit_instruct.data.sampler.InstructSampler` for
training), and :class:`UncountedPadding` gives its sample with every label ignored: it runs the same
forward and backward and adds nothing to the token-weighted sums, so the step is one process's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from lit_instruct.data.render import Sample
from lit_instruct.labels import IGNORE_INDEX


def padding_index(index: int) -> int:
    """The marked index under which sample ``index`` pads a rank's share (negative: never a sample's)."""
    return -1 - index


class EvenShards(DistributedSampler):
    """Rank ``r`` of ``W`` takes samples ``r, r + W, ...`` in order; the shares are evened out to
    ``ceil(n / W)`` with marked repeats of the first samples (:func:`padding_index`)."""

    def __init__(self, dataset: Sequence[Any], num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)  # type: ignore[arg-type]
        self.size = len(dataset)
        self.num_samples = math.ceil(self.size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.size))
        order += [padding_index(i % max(1, self.size)) for i in range(self.total_size - self.size)]
        return iter(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class UncountedPadding(Dataset):
    """``samples``, where a marked index (:func:`padding_index`) gives its sample with no label counted."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        if index >= 0:
            return self.samples[index]
        sample = self.samples[-1 - index]
        return replace(sample, labels=[IGNORE_INDEX] * len(sample.labels))
