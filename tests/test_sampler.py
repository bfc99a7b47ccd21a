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
    sampler.resume_at(epoch=2, samples_done=28, order_batch=4, batches_done=7)
    assert list(sampler) == full[28:]
    assert list(sampler) == full  # the skip applies once
    sampler.resume_at(epoch=1, samples_done=28, order_batch=4, batches_done=7)  # an epoch that is over
    assert list(sampler) == full


RUNS = [  # (batch, ranks, batches each rank trains before it stops; None: to the epoch's end)
    [(1, 2, 3), (2, 1, None)],
    [(1, 2, 3), (1, 4, None)],
    [(2, 2, 2), (3, 1, None)],
    [(1, 4, 3), (2, 3, None)],
    [(1, 2, 2), (2, 1, 2), (1, 4, 1), (3, 1, None)],  # resumed again, on yet other numbers
    [(2, 2, 5), (1, 8, None)],  # 3 samples left for 8 ranks: every rank still gets a batch
]


@pytest.mark.parametrize("runs", RUNS, ids=["->".join(f"{b}x{w}" for b, w, _ in r) for r in RUNS])
@pytest.mark.parametrize("group_by_length", [False, True])
def test_resumes_on_other_numbers_of_ranks_train_each_sample_once(runs, group_by_length) -> None:
    """An epoch trained by runs of other (batch, ranks), each resuming the last one's checkpoint: every
    sample counted once, every rank of a run as many batches (a collective never waits for a rank
    with fewer), and Lightning's count of the epoch's batches never short of them."""
    lengths = [3 + (i * 7) % 11 for i in range(23)]
    kwargs = {"group_by_length": group_by_length, "group_size": 2, "seed": 5}
    trained: list[int] = []
    position = None  # (samples done, order batch, Lightning's batches done)
    for batch, world, stop in runs:
        shares = []
        for rank in range(world):
            sampler = InstructSampler(lengths, batch, num_replicas=world, rank=rank, **kwargs)
            if position is not None:
                sampler.resume_at(0, *position)
            counted_batches = -(-len(sampler) // batch)  # what Lightning counts for the epoch
            share = list(sampler)
            before = position[2] if position else 0
            assert counted_batches - before >= -(-len(share) // batch)
            shares.append(share)
        assert len({len(share) for share in shares}) == 1
        taken = len(shares[0]) if stop is None else stop * batch
        trained += [i for share in shares for i in share[:taken]]
        before = position[2] if position else 0
        ready = before + -(-taken // batch)
        samples, order_batch = sampler.samples_done(0, ready)
        position = (samples, order_batch, ready)
    counted = [i for i in trained if i >= 0]  # marked repeats (evening out the last batch) count no token
    assert sorted(counted) == list(range(len(lengths)))


@pytest.mark.parametrize("world", [1, 2])
def test_repeated_windows_give_each_window_again_and_resume_inside_one(world: int) -> None:
    """``repeats`` 3, ``window`` 2 batches of 3: a rank's order padded with marked repeats to whole
    windows, each window given 3 times in a row; resumed after any number of batches (inside a
    window's repeats too), the rest is what the uninterrupted sampler gives."""
    lengths = LENGTHS[:23]
    samplers = [
        InstructSampler(lengths, batch_size=3, num_replicas=world, rank=r, repeats=3, window=2, seed=5)
        for r in range(world)
    ]
    for sampler in samplers:
        plain = InstructSampler(lengths, batch_size=3, num_replicas=world, rank=sampler.rank, seed=5)
        order, given = list(plain), list(sampler)
        assert len(given) == len(sampler) and len(given) % (3 * 2 * 3) == 0
        windows = [given[k : k + 6] for k in range(0, len(given), 6)]
        assert all(windows[k] == windows[k + 1] == windows[k + 2] for k in range(0, len(windows), 3))
        real = [i for w in windows[::3] for i in w if i >= 0]
        assert real == order[: len(real)] and set(order) - set(real) <= {i for i in order if i < 0}
        marked = [i for w in windows[::3] for i in w if i < 0]
        assert all(-1 - i in range(23) for i in marked)  # marked once, never a marked index's mark
        for batches in range(len(given) // 3 + 1):
            samples, order_batch, within = _placed(sampler, batches)
            resumed = InstructSampler(
                lengths, batch_size=3, num_replicas=world, rank=sampler.rank, repeats=3, window=2, seed=5
            )
            resumed.resume_at(0, samples, order_batch, batches, within)
            assert list(resumed) == given[batches * 3 :], batches


def _placed(sampler: InstructSampler, batches: int) -> tuple[int, int, int]:
    list(sampler)  # an epoch's iteration sets its position
    return sampler.place(0, batches)


def test_a_run_giving_windows_again_resumes_only_with_its_shape() -> None:
    """The feed's check of a checkpoint's windows: ``num_iterations`` and the accumulation always
    (the steps and the data's windows stay aligned), the batch size and processes inside a window."""
    from lit_instruct.data.training_feed import _repeat_skip
    from lit_instruct.errors import ConfigError

    at_start = {"repeat": {"batch_size": 2, "num_replicas": 1, "window": 2, "repeats": 2, "within": 0}}
    inside = {"repeat": {**at_start["repeat"], "within": 3}}
    assert _repeat_skip(at_start, 4, 2, 2, 2) == 0  # another batch size and world at a window's start
    assert _repeat_skip(inside, 2, 1, 2, 2) == 3
    assert _repeat_skip({}, 2, 1, 2, 1) == 0  # neither repeats
    refusals = [
        (at_start, (2, 1, 2, 3), "model.objective.init_args.num_iterations: 3"),
        (at_start, (2, 1, 1, 2), "trainer.accumulate_grad_batches: 1"),
        (inside, (4, 1, 2, 2), "data.batch_size: 4"),
        ({}, (2, 1, 2, 2), "model.objective.init_args.num_iterations: 2"),  # a checkpoint without repeats
    ]
    for state, shape, line in refusals:
        with pytest.raises(ConfigError, match=f"^{line}: the checkpoint was written"):
            _repeat_skip(state, *shape)
