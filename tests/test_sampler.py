"""InstructSampler: seeded per epoch, length-grouped, sharded by global batch, resumable."""

from __future__ import annotations

import pytest

from lit_instruct.data.even_shards import padding_index
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
    taken = [i for r in per_rank for i in r]
    assert sorted(i for i in taken if i >= 0) == list(range(203))
    assert [i for i in taken if i < 0] == [padding_index(single[0])]  # one repeat, marked: not counted


def test_resume_skips_the_batches_done_in_that_epoch_only() -> None:
    sampler = InstructSampler(LENGTHS, batch_size=4, seed=5)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.resume_at(epoch=2, batches_done=7)
    assert list(sampler) == full[28:]
    assert list(sampler) == full  # the skip applies once
    sampler.resume_at(epoch=1, batches_done=7)  # a checkpoint from an epoch that is over
    assert list(sampler) == full


@pytest.mark.parametrize(
    ("then", "now"), [((1, 2), (2, 1)), ((1, 2), (1, 4)), ((2, 2), (3, 1)), ((1, 4), (2, 3))]
)
@pytest.mark.parametrize("group_by_length", [False, True])
def test_a_resume_on_another_number_of_ranks_trains_each_sample_once(then, now, group_by_length) -> None:
    """(batch, ranks) of the run that wrote the checkpoint, then of the one resuming it: the samples
    the first trained and those the second trains in that epoch are the epoch's, each counted once."""
    lengths = [3 + (i * 7) % 11 for i in range(23)]
    (batch, world), (new_batch, new_world) = then, now
    kwargs = {"group_by_length": group_by_length, "group_size": 2, "seed": 5}
    before = [InstructSampler(lengths, batch, num_replicas=world, rank=r, **kwargs) for r in range(world)]
    done = 3  # batches each rank had trained
    trained = [i for sampler in before for i in sampler.rank_order(0)[: done * batch]]
    after = []
    for rank in range(new_world):
        sampler = InstructSampler(lengths, new_batch, num_replicas=new_world, rank=rank, **kwargs)
        sampler.resume_at(0, done, batch_size=batch, num_replicas=world)
        batches = -(-len(sampler) // new_batch)  # what Lightning counts: the done ones and those left
        share = list(sampler)
        assert batches - done == -(-len(share) // new_batch)
        after += share
    seen = trained + after
    counted = [i for i in seen if i >= 0]  # marked repeats (evening out the last batch) count no token
    assert sorted(counted) == list(range(len(lengths)))
    assert len(seen) - len(counted) < new_world
