"""Sampling with the adapters merged into copies of their base weights
(lit_instruct.models.merged_sampling): the model computes what PEFT's own merged model computes, and
its base weights and adapters are as they were after."""

from __future__ import annotations

import copy

import torch

from lit_instruct.models.lora import LoRAConfig
from lit_instruct.models.merged_sampling import merged_adapters
from lit_instruct.train.module import InstructLoRAModule
from tests.test_preference_loss import _perturb_lora


def test_merged_sampling_computes_peft_merged_models_logits_and_leaves_the_weights(tiny_model_dir) -> None:
    module = InstructLoRAModule(
        model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8, target_modules="all-linear"), dtype="float32"
    )
    model = module.model
    _perturb_lora(model, scale=0.05)
    model.eval()
    merged_by_peft = copy.deepcopy(model).merge_and_unload()  # PEFT's own merge: the reference
    ids = torch.randint(0, 1000, (3, 17), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        with module.sampling_model(merged=True) as sampling:
            merged = sampling(input_ids=ids).logits
            layers = sum(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))
            greedy = sampling.generate(input_ids=ids[:, :5], max_new_tokens=8, do_sample=False)
        theirs = merged_by_peft(input_ids=ids).logits
        their_greedy = merged_by_peft.generate(input_ids=ids[:, :5], max_new_tokens=8, do_sample=False)
    assert layers == 2 * 7  # every projection of both layers merged
    torch.testing.assert_close(merged, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)
    assert torch.equal(greedy, their_greedy)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n].detach(), before[n]) for n in before)  # the very weights, untouched
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))


def test_layers_it_cannot_merge_keep_loras_path(tiny_model_dir) -> None:
    """DoRA's magnitude is not a plain merge: such a layer stays on PEFT's path."""
    module = InstructLoRAModule(
        model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8, target_modules=["q_proj"], use_dora=True)
    )
    with merged_adapters(module.model) as count:
        assert count == 0
