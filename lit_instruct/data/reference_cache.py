"""The reference model's log-probabilities computed once and kept with the pairs.

DPO and IPO score every pair against a frozen reference. Its log-probabilities do not change during
training, so they can be computed once, before the first step, and carried by the batches
(``reference_logps``, :class:`~lit_instruct.data.preference.PreferenceCollator`): each step then
runs the policy alone. The pairs are shared out over the ranks (every rank the same number of
batches: a sharded model's forward is a collective), computed where they land, and summed over
the ranks, so every rank holds every pair's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from lit_instruct.data.preference import PreferencePair

ReferenceFn = Callable[[dict[str, Any]], torch.Tensor]
"""A ``[chosen rows; rejected rows]`` batch -> its ``(2P,)`` summed reference log-probabilities."""


def rank_indices(count: int, world_size: int, rank: int) -> list[int]:
    """This rank's pair indices (every ``world_size``-th from ``rank``), repeated at the end (the
    repeats marked ``-1 - index``) so that every rank has ``ceil(count / world_size)``."""
    own = list(range(rank, count, world_size))
    share = -(-count // world_size)
    repeat = own[0] if own else 0
    return own + [-1 - repeat] * (share - len(own))


def compute_reference(
    pairs: Sequence[PreferencePair],
    collate: Callable[[list[PreferencePair]], dict[str, Any]],
    reference: ReferenceFn,
    batch_size: int,
    world_size: int = 1,
    rank: int = 0,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> list[PreferencePair]:
    """``pairs`` with their reference log-probabilities set (``PreferencePair.reference``).

    Args:
        pairs: one split's pairs.
        collate: pairs -> a batch (the training collator, so the rows are padded as in training).
        reference: a batch -> its ``(2P,)`` reference sums (``P`` chosen, then ``P`` rejected).
        batch_size: pairs per forward.
        world_size, rank, all_reduce_sum: the ranks sharing the work, and a sum over them (a
            collective every rank calls).
    """
    indices = rank_indices(len(pairs), world_size, rank)
    values = torch.zeros(len(pairs), 2, dtype=torch.float64)
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        batch = collate([pairs[i if i >= 0 else -1 - i] for i in chunk])
        sums = reference(batch).detach().double().cpu()
        own = [k for k, i in enumerate(chunk) if i >= 0]
        rows = torch.tensor([chunk[k] for k in own], dtype=torch.long)
        chosen, rejected = sums.chunk(2)
        values[rows] = torch.stack([chosen[own], rejected[own]], dim=1)
    values = all_reduce_sum(values)
    return [
        replace(pair, reference=(float(c), float(r)))
        for pair, (c, r) in zip(pairs, values.tolist(), strict=True)
    ]
