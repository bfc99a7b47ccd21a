"""Where LoRA lands: every linear layer and expert weight asked for, or an error naming what peft
left out; routers and Mamba ``out_proj`` left out by name; GPT-2's ``Conv1D`` counted."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel

from lit_instruct.models.lora import LoRAConfig, attach_lora
from lit_instruct.models.lora_targets import LoRACoverageError, _peft_names
from tests.families import tiny_model

VOCAB = 128


def tiny(name: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(name, VOCAB)


def lora_gradients_after_a_step(model) -> dict[str, torch.Tensor | None]:
    with torch.no_grad():  # non-zero B: every adapter's A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    ids = torch.randint(0, VOCAB, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_gpt2_conv1d_layers_are_adapted() -> None:
    model = attach_lora(tiny("gpt2"), LoRAConfig(r=4))
    coverage = model.lora_coverage
    assert coverage.targets.modules == [
        f"transformer.h.{i}.{name}"
        for i in (0, 1)
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert coverage.line() == "LoRA: 8 of 8 linear layers"
    grads = lora_gradients_after_a_step(model)
    assert len(grads) == 16 and all(g is not None and g.abs().max() > 0 for g in grads.values())


def test_a_router_is_left_out_by_name_and_the_model_trains() -> None:
    model = attach_lora(tiny("phimoe"), LoRAConfig(r=4))
    coverage = model.lora_coverage
    assert coverage.targets.left_out == {
        "PhimoeTopKRouter (its forward is not a plain linear layer: a router)": [
            "model.layers.0.mlp.router",
            "model.layers.1.mlp.router",
        ]
    }
    assert coverage.line().startswith(
        "LoRA: 8 of 8 linear layers, 4 of 4 expert weights (left out: PhimoeTopKRouter"
    )
    grads = lora_gradients_after_a_step(model)  # a LoRA layer around the router failed here
    assert grads and all(g is not None for g in grads.values())


def test_modules_peft_would_rewrite_into_experts_are_adapted_through_their_weight(tmp_path) -> None:
    dense = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    shared = [f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    model = attach_lora(tiny("deepseek_v3"), LoRAConfig(r=4))
    coverage = model.lora_coverage
    assert coverage.line() == "LoRA: 16 of 16 linear layers, 2 of 2 expert weights"
    assert coverage.targets.by_weight == dense + shared
    assert set(model.peft_config["default"].target_parameters) >= {f"{n}.weight" for n in dense + shared}
    grads = lora_gradients_after_a_step(model)
    adapters = [f"base_model.model.{n}.lora_{f}.default.weight" for n in dense for f in "AB"]
    assert all(grads[name].abs().max() > 0 for name in adapters)

    # the same update as a module adapter, and peft loads it back onto the same layers
    ids = torch.randint(0, VOCAB, (2, 7))
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny("deepseek_v3"), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
        layer = model.base_model.model.model.layers[0].mlp.gate_proj
        x = torch.randn(3, 64)
        scale = layer.scaling["default"]
        delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(layer(x), x @ (layer.get_base_layer().weight + scale * delta).T)


def with_a_custom_shared_up_proj() -> torch.nn.Module:
    base = tiny("deepseek_v3")
    base.model.layers[1].mlp.shared_experts.up_proj = Subclassed(64, 32, bias=False)
    return base


def test_a_layer_peft_rewrites_that_cannot_be_adapted_by_weight_is_an_error() -> None:
    with pytest.raises(LoRACoverageError) as refused:
        attach_lora(with_a_custom_shared_up_proj(), LoRAConfig(r=4))
    message = str(refused.value)
    assert message.startswith(
        "LoRA: 15 of 16 linear layers, 2 of 2 expert weights: "
        "no adapter on model.layers.1.mlp.shared_experts.up_proj"
    )
    assert "for deepseek_v3 models" in message and "model.lora.allow_partial: true" in message
    model = attach_lora(with_a_custom_shared_up_proj(), LoRAConfig(r=4, allow_partial=True))
    assert model.lora_coverage.missing_modules == ["model.layers.1.mlp.shared_experts.up_proj"]
    assert model.lora_coverage.hparams()["model/lora_linear_adapted"] == 15.0


class Subclassed(torch.nn.Linear):
    """A linear layer of a class of its own (as a quantized or custom layer would be)."""


def test_a_linear_attention_out_proj_is_adapted() -> None:
    model = attach_lora(tiny("qwen3_next"), LoRAConfig(r=4))
    coverage = model.lora_coverage
    assert "model.layers.0.linear_attn.out_proj" in coverage.targets.modules
    assert "model.layers.0.linear_attn.out_proj" in model.base_model.targeted_module_names
    assert not coverage.targets.left_out


def test_peft_gets_leaf_names_only_where_they_match_exactly_what_is_asked() -> None:
    names = ["layers", "layers.0", "layers.0.q_proj", "layers.0.altup.0", "layers.1", "layers.1.q_proj"]
    assert _peft_names(names, ["layers.0.q_proj", "layers.1.q_proj"]) == ["q_proj"]
    # "0" would also match the decoder layer "layers.0"
    assert _peft_names(names, ["layers.0.altup.0"]) == ["layers.0.altup.0"]


def test_layers_the_model_never_calls_are_left_out_by_the_build_probe() -> None:
    """Jamba computes ``dt_proj.weight @ x`` itself: an adapter on dt_proj would never train."""
    dt_proj = ["model.layers.0.mamba.dt_proj"]
    for asked in (["all-linear"], ["x_proj", "dt_proj"]):
        model = attach_lora(tiny("jamba"), LoRAConfig(r=4, target_modules=asked))
        coverage = model.lora_coverage
        assert list(coverage.targets.left_out.values()) == [dt_proj]
        assert "dt_proj (its parent reads the weight, never calling the layer" in coverage.line()
        assert not any("dt_proj" in name for name in model.base_model.targeted_module_names)
        grads = lora_gradients_after_a_step(model)  # every adapter placed trains
        assert grads and all(g is not None and g.abs().max() > 0 for g in grads.values())


def test_dropout_where_peft_adapts_through_the_weight_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.dropout is 0\.1, but model\.layers\.1\.mlp\.experts"):
        attach_lora(tiny("deepseek_v3"), LoRAConfig(r=4, dropout=0.1))
