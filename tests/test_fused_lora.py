"""The fused LoRA layers (``model.fuse_lora``) against PEFT's own forward: same losses, same adapter
gradients, same training; PEFT's forward wherever a call is not plain LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.models.fused_lora import fuse_lora
from lit_instruct.models.lora import LoRAConfig, attach_lora
from lit_instruct.train.module import InstructLoRAModule
from tests.families import build_family
from tests.helpers import Recorder, make, trainer
from tests.test_families import VOCAB, assert_relatively_close, lora_grads, our_loss, samples

FUSED = {  # family -> (SwiGLU MLPs, q/k/v groups) fused in its 2 layers
    "llama": (2, 2),
    "qwen2": (2, 2),  # q/k/v with biases
    "mistral": (2, 2),
    "phi3": (0, 0),  # one qkv_proj / gate_up_proj already: left to PEFT
    "gemma": (0, 2),  # GELU MLP: left to PEFT
}


def tiny_peft(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = attach_lora(LlamaForCausalLM(config), LoRAConfig(r=4, alpha=8, dropout=dropout))
    with torch.no_grad():  # non-zero B: both LoRA factors get gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    loss = model(input_ids=ids, labels=ids).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_modules_equal_pefts_loss_and_gradients(name, tmp_path) -> None:
    path = build_family(name, VOCAB, tmp_path / name)
    fused = InstructLoRAModule(model=str(path), lora=LoRAConfig(r=4, alpha=8), fuse_lora=True)
    plain = InstructLoRAModule(model=str(path), lora=LoRAConfig(r=4, alpha=8), fuse_lora=False)
    torch.manual_seed(1)
    with torch.no_grad():
        for param_name, p in fused.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    plain.load_state_dict(fused.state_dict())
    assert fused.fused_layers is not None
    assert (fused.fused_layers.mlps, fused.fused_layers.attention_groups) == FUSED[name]
    batch = PadCollator(0)(samples())
    expected = our_loss(plain, batch)
    ours = our_loss(fused, batch)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    expected_grads = lora_grads(plain, expected)
    for key, grad in lora_grads(fused, ours).items():
        assert_relatively_close(grad, expected_grads[key], f"{name} {key}")


def test_calls_that_are_not_plain_lora_run_pefts_forward() -> None:
    """Dropout, a disabled adapter and autocast each take PEFT's own path (same random numbers)."""
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    for dropout in (0.0, 0.3):
        model = tiny_peft(dropout)
        reference = copy.deepcopy(model)
        assert fuse_lora(model).mlps == 2
        torch.manual_seed(5)
        ours = loss_and_grads(model, ids)
        torch.manual_seed(5)
        expected = loss_and_grads(reference, ids)
        for a, b in zip(ours, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model.eval(), reference.eval()
    with torch.no_grad(), model.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


class NotSwiGLU(nn.Module):
    """Named like a SwiGLU MLP but adds the branches: the build-time check must catch it."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            mlp.act_fn,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


def test_a_layer_that_differs_from_its_fused_form_stays_on_peft_s_path() -> None:
    model = tiny_peft()
    layer = model.get_base_model().model.layers[0]
    layer.mlp = NotSwiGLU(layer.mlp)
    x = torch.randn(1, 3, 32)
    before = layer.mlp(x)
    with pytest.warns(UserWarning, match=r"fused LoRA left 1 layers on PEFT's own path .*layers\.0\.mlp"):
        fused = fuse_lora(model)
    assert fused.left_unfused == ["base_model.model.model.layers.0.mlp"]
    assert fused.mlps == len(model.get_base_model().model.layers) - 1
    assert "forward" not in vars(layer.mlp)
    torch.testing.assert_close(layer.mlp(x), before)


def test_training_with_fused_layers_equals_training_without(tiny_model_dir, chat_file, tmp_path) -> None:
    """Three packed optimizer steps: the same loss at every step (1e-5) and the same adapter (1e-5
    absolute: Adam amplifies rounding in near-zero gradients to a fraction of its step)."""
    runs = {}
    for fused in (True, False):
        module, data = make(tiny_model_dir, chat_file, packing=True, fuse_lora=fused)
        assert (module.fused_layers is not None) == fused
        recorder = Recorder()
        trainer(tmp_path / str(fused), max_steps=3, callbacks=[recorder], strategy="one_device").fit(
            module, data
        )
        runs[fused] = recorder
    torch.testing.assert_close(runs[True].losses, runs[False].losses, rtol=1e-5, atol=1e-6)
    for key, weight in runs[False].states[-1][0].items():  # Adam moves each weight by ~lr = 1e-2
        torch.testing.assert_close(runs[True].states[-1][0][key], weight, rtol=1e-4, atol=1e-5)
    assert len(runs[True].losses) == 3


def test_packed_rows_through_fused_layers_equal_padded(tiny_model_dir) -> None:
    from lit_instruct.data.render import Sample

    module = InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8), packing=True)
    ids = [list(range(5, 16)), list(range(20, 27))]
    batch = [Sample(x, [-100] * 3 + x[3:], "test") for x in ids]
    packed = module.loss_sum_and_count(PackCollator()(batch))
    padded = module.loss_sum_and_count(PadCollator(0)(batch))
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    assert packed[1] == padded[1]
