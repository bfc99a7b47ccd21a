"""``model.preference.precompute_reference``: the reference log-probabilities computed once before
training, shared out over ranks, carried by the batches; training with them equals training with the
reference pass in every step (fresh and from an SFT adapter), and the steps no longer run it."""

from __future__ import annotations

import math

import pytest
import torch

from lit_instruct.data.reference_cache import compute_reference, rank_indices
from lit_instruct.errors import ConfigError
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import pair_logps, pair_losses, recorded_fit
from tests.test_preference_loss import _perturb_lora
from tests.test_preference_module import LORA, _data, pairs_file  # noqa: F401  (pairs_file: a fixture)


@pytest.mark.parametrize("count, world", [(5, 2), (4, 2), (1, 3), (7, 1)])
def test_rank_indices_cover_every_pair_once_in_equal_shares(count, world):
    shares = [rank_indices(count, world, rank) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # the same number of forwards on every rank
    real = sorted(i for share in shares for i in share if i >= 0)
    assert real == list(range(count))
    assert all(-1 - i < count for share in shares for i in share if i < 0)


class CountingReference(InstructLoRAModule):
    """Counts the reference passes (the model switched to the reference)."""

    def reference_model(self):
        self.reference_passes = getattr(self, "reference_passes", 0) + 1
        return super().reference_model()


def _reference_of_every_pair(module: InstructLoRAModule, data) -> list[tuple[float, float]]:
    """Each training pair's reference sums from its own one-pair batch (an independent path)."""
    collate = data._collator()
    values = []
    for pair in data.pairs("train").pairs:
        with torch.no_grad(), module.reference_model():
            logps = pair_logps(module, collate([pair]))
        values.append((float(logps.chosen), float(logps.rejected)))
    return values


def test_cached_values_match_each_pairs_own_reference_and_ranks_share_the_work(
    tiny_model_dir,
    pairs_file,  # noqa: F811
):
    module = InstructLoRAModule(model=str(tiny_model_dir), lora=LORA, objective="dpo")
    _perturb_lora(module.model)  # the reference (adapter off) differs from the policy
    data = _data(tiny_model_dir, pairs_file, batch_size=2)
    expected = torch.tensor(_reference_of_every_pair(module, data), dtype=torch.float64)
    pairs, collate = data.pairs("train").pairs, data._collator()

    def reference(batch):
        with torch.no_grad(), module.reference_model():
            logps = pair_logps(module, batch)
        return torch.cat([logps.chosen, logps.rejected])

    one = compute_reference(pairs, collate, reference, batch_size=3)
    torch.testing.assert_close(torch.tensor([p.reference for p in one], dtype=torch.float64), expected)
    # two ranks: each computes its share (zeros elsewhere); the sum over them is every pair's value
    parts = [
        torch.tensor([p.reference for p in compute_reference(pairs, collate, reference, 2, 2, rank)])
        for rank in (0, 1)
    ]
    assert all(bool((part == 0).any()) for part in parts)
    torch.testing.assert_close((parts[0] + parts[1]).double(), expected)


@pytest.mark.parametrize("from_sft", [False, True], ids=["fresh", "from-sft-adapter"])
def test_training_on_cached_reference_equals_the_reference_in_every_step(
    tiny_model_dir,
    pairs_file,  # noqa: F811
    tmp_path,
    from_sft,
):
    adapter = None
    if from_sft:
        sft = InstructLoRAModule(model=str(tiny_model_dir), lora=LORA)
        _perturb_lora(sft.model)
        adapter = str(sft.write_adapter(tmp_path / "sft"))
    runs = {}
    for cached in (False, True):
        torch.manual_seed(0)
        module = CountingReference(
            model=str(tiny_model_dir),
            lora=None if from_sft else LORA,
            adapter=adapter,
            warmup_steps=0,
            learning_rate=1e-2,
            preference=PreferenceConfig(precompute_reference=cached),
        )
        if not from_sft:
            _perturb_lora(module.model)
        data = _data(tiny_model_dir, pairs_file, batch_size=2)
        data.eval_batch_size = 5  # the precomputation's batches: all 5 pairs in one
        recorder = recorded_fit(module, data, tmp_path / str(cached), 3)
        runs[cached] = (recorder, module.reference_passes)
    (stepwise, stepwise_passes), (cached_run, cached_passes) = runs[False], runs[True]
    assert stepwise_passes == 3 and cached_passes == 1  # one per step, or one for all pairs, once
    torch.testing.assert_close(cached_run.losses, stepwise.losses, rtol=1e-5, atol=1e-6)
    for (after_cached, _, _), (after_stepwise, _, _) in zip(cached_run.states, stepwise.states, strict=True):
        for name, weight in after_stepwise.items():
            torch.testing.assert_close(after_cached[name], weight, rtol=1e-5, atol=1e-7, msg=name)


def test_precompute_reference_is_refused_where_there_is_no_reference(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"model\.preference\.precompute_reference: applies to dpo and ipo"):
        InstructLoRAModule(
            model=str(tiny_model_dir), preference=PreferenceConfig("simpo", precompute_reference=True)
        )


def _reference_fn(module: InstructLoRAModule):
    def reference(batch):
        with torch.no_grad(), module.reference_model():
            logps = pair_logps(module, batch)
        return torch.cat([logps.chosen, logps.rejected])

    return reference


def test_a_second_module_on_the_same_data_is_never_scored_against_the_first_ones_reference(
    tiny_model_dir,
    pairs_file,  # noqa: F811
    tmp_path,
):
    """Module A continues an SFT adapter (its reference: the SFT model) and caches its values on the
    data module; a fresh module B (its reference: the base) on the same data module must start at
    ln 2, with the cache off (ignoring the batches' values) and on (computing its own)."""
    sft = InstructLoRAModule(model=str(tiny_model_dir), lora=LORA)
    _perturb_lora(sft.model)
    first = InstructLoRAModule(
        model=str(tiny_model_dir),
        adapter=str(sft.write_adapter(tmp_path / "sft")),
        preference=PreferenceConfig(precompute_reference=True),
    )
    data = _data(tiny_model_dir, pairs_file, batch_size=5)
    assert data.cache_reference(_reference_fn(first), first.objective.reference_key) == 5
    assert (
        data.cache_reference(_reference_fn(first), first.objective.reference_key) == 0
    )  # kept: computed once
    firsts = torch.tensor([p.reference for p in data.pairs("train").pairs], dtype=torch.float64)

    for precompute in (False, True):
        second = InstructLoRAModule(
            model=str(tiny_model_dir), lora=LORA, preference=PreferenceConfig(precompute_reference=precompute)
        )
        own = _reference_fn(second)(data._collator()(data.pairs("train").pairs)).double()
        assert not torch.allclose(own, torch.cat([firsts[:, 0], firsts[:, 1]]))  # reading A's would show
        if precompute:
            assert (
                data.cache_reference(_reference_fn(second), second.objective.reference_key, ("train",)) == 5
            )
        batch = next(iter(data.train_dataloader()))
        assert "reference_logps" in batch
        second.train()
        loss_sum, _, pairs, _ = pair_losses(second, batch)
        assert float(loss_sum) / pairs == pytest.approx(math.log(2), rel=1e-6), precompute
