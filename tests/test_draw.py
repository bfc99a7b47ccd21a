"""The sampler's draw (lit_instruct.objectives.sampler.Draw): the distribution ``generate`` samples
from (temperature, top-k, top-p), written out here, within sampling error over many rows."""

from __future__ import annotations

import pytest
import torch

from lit_instruct.objectives.sampler import Draw, SamplingSettings

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.1, -2.0, 0.0, 0.9])


def expected(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The probabilities after the warpers, by hand: divide, keep the k largest, then the smallest
    set of the largest whose mass reaches top_p (a token is dropped when the mass above it already
    does), renormalize."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=0)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass = 0.0
    final = torch.zeros_like(keep)
    for index in torch.argsort(kept, descending=True).tolist():
        if kept[index] == 0 or mass >= top_p:
            break
        final[index] = True
        mass += float(kept[index])
    out = torch.where(final, kept, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8)])
def test_draws_follow_the_warped_distribution(temperature, top_k, top_p) -> None:
    rows = 200_000
    draw = Draw(SamplingSettings(8, temperature, top_p, top_k), torch.Generator().manual_seed(0))
    scores = draw(torch.zeros((rows, 1), dtype=torch.long), LOGITS.repeat(rows, 1))
    assert torch.equal((scores == 0).sum(dim=1), torch.ones(rows, dtype=torch.long))  # one token a row
    assert torch.isinf(scores).sum() == rows * (len(LOGITS) - 1)
    frequencies = torch.bincount(scores.argmax(dim=1), minlength=len(LOGITS)).double() / rows
    probs = expected(temperature, top_k, top_p)
    assert torch.equal(frequencies == 0, probs == 0)  # nothing outside top-k / top-p is ever drawn
    sigma = (probs * (1 - probs) / rows).sqrt()
    assert torch.all((frequencies - probs).abs() <= 5 * sigma + 1e-12), (frequencies, probs)


def test_a_seed_gives_the_same_draws_and_leaves_the_global_stream() -> None:
    state = torch.get_rng_state()
    settings = SamplingSettings(8, 0.7)
    scores = LOGITS.repeat(64, 1)
    first = Draw(settings, torch.Generator().manual_seed(3))(None, scores.clone()).argmax(dim=1)
    again = Draw(settings, torch.Generator().manual_seed(3))(None, scores.clone()).argmax(dim=1)
    other = Draw(settings, torch.Generator().manual_seed(4))(None, scores.clone()).argmax(dim=1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.get_rng_state(), state)
