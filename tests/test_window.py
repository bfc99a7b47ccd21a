"""The token-weighted window: totals over micro-batches and ranks, and the gradient factor."""

from __future__ import annotations

import pytest
import torch

from lit_instruct.batch import num_response_tokens, num_tokens
from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.data.render import Sample
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.train.window import StepWindow, WindowTotals, gradient_factor, scale_gradients


def test_window_totals_micro_batches_and_starts_empty_again() -> None:
    window = StepWindow()
    window.add(torch.tensor(6.0, requires_grad=True), count=3, tokens=10, answer_tokens=3)
    window.add(torch.tensor(2.5), count=2, tokens=7, answer_tokens=2)
    totals = window.close(lambda t: t, torch.device("cpu"))
    assert totals == WindowTotals(loss_sum=8.5, count=5, tokens=17, answer_tokens=5)
    assert totals.loss == pytest.approx(8.5 / 5)
    assert window.close(lambda t: t, torch.device("cpu")) == WindowTotals(0.0, 0, 0, 0)
    assert WindowTotals(0.0, 0, 0).loss == 0.0


def test_window_sums_over_ranks_with_the_reduction_it_is_given() -> None:
    """Two ranks: this one saw (4.0, 2, 5), the other (9.0, 3, 8); the all-reduce adds them."""
    other = torch.tensor([3, 8, 3, 9.0], dtype=torch.float64)  # count, tokens, answer tokens, loss
    window = StepWindow()
    window.add(torch.tensor(4.0), count=2, tokens=5, answer_tokens=2)
    assert window.close(lambda t: t + other, torch.device("cpu")) == WindowTotals(13.0, 5, 13, 5)
    empty = StepWindow()  # a rank without micro-batches still takes part in the collective
    assert empty.close(lambda t: t + other, torch.device("cpu")) == WindowTotals(9.0, 3, 8, 3)


def test_window_metrics_are_means_over_every_counted_unit() -> None:
    """Pairs: the metric sums of two micro-batches over ranks, divided by all their pairs."""
    window = StepWindow(["rewards/margins", "rewards/accuracies"])
    window.add(torch.tensor(1.5), count=2, metric_sums=torch.tensor([0.4, 1.0]))
    window.add(torch.tensor(0.5), count=1, metric_sums=torch.tensor([-0.1, 0.0]))
    other = torch.tensor([1, 0, 0, 0.7, 0.2, 1.0], dtype=torch.float64)  # a rank with one pair
    totals = window.close(lambda t: t + other, torch.device("cpu"))
    assert totals.count == 4 and totals.loss == pytest.approx(2.7 / 4)
    assert totals.metrics() == pytest.approx({"rewards/margins": 0.5 / 4, "rewards/accuracies": 2.0 / 4})


def test_counts_stay_exact_beyond_float32_integers() -> None:
    window = StepWindow()
    window.add(torch.tensor(1.0), count=2**24 + 1, tokens=2**25 + 1)
    assert window.close(lambda t: t, torch.device("cpu")).count == 2**24 + 1


@pytest.mark.parametrize(("accumulate", "world_size"), [(1, 1), (3, 1), (2, 4)])
def test_gradient_becomes_that_of_the_token_weighted_mean(accumulate: int, world_size: int) -> None:
    """What Lightning and DDP leave (each micro-batch's sum / accumulate, averaged over ranks) times
    the factor is the gradient of sum(CE) / count over the whole window."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, generator=gen, requires_grad=True)
    inputs = [torch.randn(n, 5, generator=gen) for n in (1, 4, 2, 7, 3, 2, 5, 1)[: accumulate * world_size]]
    count = sum(len(x) for x in inputs)
    per_rank = [inputs[r * accumulate : (r + 1) * accumulate] for r in range(world_size)]
    rank_grads = []
    for batches in per_rank:
        weight.grad = None
        for x in batches:
            ((x @ weight).square().sum() / accumulate).backward()
        rank_grads.append(weight.grad.clone())
    weight.grad = torch.stack(rank_grads).mean(0)  # DDP's average
    scale_gradients([weight], gradient_factor(count, accumulate, world_size))
    expected = torch.autograd.grad(sum((x @ weight).square().sum() for x in inputs) / count, weight)[0]
    torch.testing.assert_close(weight.grad, expected)


def test_scale_gradients_skips_parameters_without_a_gradient() -> None:
    with_grad, without = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    with_grad.grad = torch.full((3,), 2.0)
    scale_gradients([with_grad, without], 0.5)
    assert torch.equal(with_grad.grad, torch.ones(3)) and without.grad is None
    assert gradient_factor(0, 2, 1) == 2.0  # no response token: nothing to divide by


SAMPLES = [
    Sample([5, 6, 7, 8], [IGNORE_INDEX, IGNORE_INDEX, 7, 8], "a"),
    Sample([9, 10], [9, 10], "b"),  # the first label is never predicted
    Sample([11, 12, 13], [IGNORE_INDEX] * 3, "c"),
]


@pytest.mark.parametrize("collator", [PadCollator(pad_id=0, pad_to_multiple_of=8), PackCollator()])
def test_collators_carry_the_counts_their_tensors_give(collator) -> None:
    batch = collator(SAMPLES)
    assert (batch["num_tokens"], batch["num_response_tokens"]) == (9, 3)
    counted = {k: v for k, v in batch.items() if not k.startswith("num_")}
    if "attention_mask" not in counted:
        assert counted["input_ids"].numel() == 9  # a packed row has no padding
    assert num_tokens(counted) == batch["num_tokens"]
    assert num_response_tokens(counted) == batch["num_response_tokens"]
    assert num_tokens(batch) == 9 and num_response_tokens(batch) == 3
