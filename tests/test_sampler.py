"""InstructSampler: seeded per epoch, length-grouped, sharded by global batch, resumable."""

from __future__ import annotations

import pytest

from lit_instruct.data.sampler import InstructSampler

LENGTHS = [(i * 37) % 101 for i in range(203)]


def test_length_grouped_order_is_a_seeded_permutation_of_similar_length_batches() -> None:
    sampler = InstructSampler(LENGTHS, batch_size=4, group_by_length=True, group_size=10, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(203))
    assert order == list(InstructSampler(LENGTHS, batch_size=4, group_by_length=True, group_size=10, seed=3))
    sampler.set_epoch(1)
    assert list(sampler) != order
    batches = [[LENGTHS[i] for i in order[k : k + 4]] for k in range(0, 200, 4)]
    assert sum(max(b) - min(b) for b in batches) / len(batches) < 10  # a random batch spreads ~60


@pytest.mark.parametrize("group_by_length", [False, True])
def test_ranks_split_each_global_batch_of_the_single_process_order(group_by_length: bool) -> None:
    grouped = {"group_by_length": group_by_length, "seed": 1}
    one = InstructSampler(LENGTHS, batch_size=6, **grouped)
    ranks = [InstructSampler(LENGTHS, batch_size=2, num_replicas=3, rank=r, **grouped) for r in range(3)]
    single, per_rank = list(one), [list(r) for r in ranks]
    assert [len(r) for r in per_rank] == [68, 68, 68] == [len(r) for r in ranks]  # 203 padded to 204
    for g in range(203 // 6):  # every full global batch is the single process's batch
        together = [i for r in per_rank for i in r[2 * g : 2 * g + 2]]
        assert together == single[6 * g : 6 * g + 6]
    assert sorted(i for r in per_rank for i in r) == sorted([*range(203), single[0]])  # one sample repeated


def test_resume_skips_the_batches_done_in_that_epoch_only() -> None:
    sampler = InstructSampler(LENGTHS, batch_size=4, seed=5)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.resume_at(epoch=2, batches_done=7)
    assert list(sampler) == full[28:]
    assert list(sampler) == full  # the skip applies once
    sampler.resume_at(epoch=1, batches_done=7)  # a checkpoint from an epoch that is over
    assert list(sampler) == full
