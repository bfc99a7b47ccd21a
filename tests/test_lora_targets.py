"""Where LoRA lands: every linear layer and expert weight asked for and nothing else, or an error
naming what peft left out or added; routers and Mamba ``out_proj`` left out by name; GPT-2's
``Conv1D`` counted; linear subclasses adapted when their forward is a plain linear map, refused by
name when not; every name a LoRA setting gives checked against the model, on its meta skeleton."""

from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from lit_instruct.errors import ConfigError
from lit_instruct.models.lora import LoRAConfig, attach_lora
from lit_instruct.models.lora_targets import (
    LoRAConfigError,
    LoRACoverage,
    LoRACoverageError,
    _peft_names,
    check_coverage,
    check_lora_names,
    lora_targets,
)
from tests.families import FAMILIES, meta_model, tiny_model

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
        "model.lora.target_modules: LoRA: 15 of 16 linear layers, 2 of 2 expert weights: "
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
    refusal = (
        r"^model\.lora\.dropout: 0\.1 cannot be combined with model\.lora\.target_modules \['all-linear'\] "
    )
    with pytest.raises(ConfigError, match=refusal + r"here: model\.layers\.1\.mlp\.experts"):
        attach_lora(tiny("deepseek_v3"), LoRAConfig(r=4, dropout=0.1))


LAYER = re.compile(r"\.layers\.(\d+)\.")


def expected_adapters(base: torch.nn.Module) -> Counter[str]:
    """From the bare model's parameters: the module owning each weight LoRA must adapt (an
    ``nn.Linear`` weight but the head's, or a 3-D expert weight; twice for a module with two)."""
    head = base.get_output_embeddings()
    owners: Counter[str] = Counter()
    for name, p in base.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = base.get_submodule(owner_name)
        linear = isinstance(owner, torch.nn.Linear) and owner is not head and leaf == "weight"
        if linear or p.dim() == 3:
            owners[owner_name] += 1
    return owners


def placed_adapters(model, factor: str) -> Counter[str]:
    """From the peft model's parameters: the module each ``lora_A`` / ``lora_B`` tensor adapts."""
    owners: Counter[str] = Counter()
    for name, _ in model.named_parameters():
        if f".{factor}." in name:
            owner = name.removeprefix("base_model.model.").split(f".{factor}.")[0]
            owners[owner.replace(".base_layer", "")] += 1
    return owners


def layer_of(name: str) -> int:
    found = LAYER.search(f"{name}.")
    assert found is not None, name
    return int(found.group(1))


@pytest.mark.parametrize(
    ("family", "layers"), [("mixtral", [1]), ("deepseek_v3", [1]), ("deepseek_v3", [0]), ("llama", [1])]
)
def test_layers_to_transform_puts_adapters_on_those_layers_only(family, layers) -> None:
    """Expert weights and the dense layers adapted through their weight included (peft applies
    ``layers_to_transform`` to ``target_modules`` only)."""
    every = expected_adapters(tiny(family))
    expected = Counter({name: k for name, k in every.items() if layer_of(name) in layers})
    assert expected and expected != every
    model = attach_lora(tiny(family), LoRAConfig(r=4, layers_to_transform=layers))
    assert placed_adapters(model, "lora_A") == expected == placed_adapters(model, "lora_B")
    assert all(layer_of(n) in layers for n, _ in model.named_parameters() if "parametrizations" in n)
    experts = sum(k for n, k in expected.items() if n.endswith(".experts"))
    linear = sum(expected.values()) - experts
    line = model.lora_coverage.line()
    assert line == f"LoRA: {linear} of {linear} linear layers" + (
        f", {experts} of {experts} expert weights" if experts else ""
    )


def test_an_adapter_nobody_asked_for_is_an_error() -> None:
    base = tiny("llama")
    targets = lora_targets(base, ["q_proj"])
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for allow_partial in (False, True):
        with pytest.raises(
            LoRACoverageError,
            match=r"^model\.lora\.target_modules: LoRA: 2 of 2 linear layers: peft also put adapters on "
            r"model\.layers\.0\.self_attn\.v_proj, model\.layers\.1\.self_attn\.v_proj, which nobody",
        ):
            check_coverage(peft_model, targets, allow_partial)


def test_an_expert_weight_nobody_asked_for_is_an_error() -> None:
    base = tiny("mixtral")
    targets = lora_targets(base, ["all-linear"], layers=[1])
    config = LoraConfig(r=4, target_modules=targets.peft_modules, target_parameters=["experts.down_proj"])
    peft_model = get_peft_model(base, config)
    with pytest.raises(
        LoRACoverageError, match=r"peft also put adapters on model\.layers\.0\.mlp\.experts\.down_proj,"
    ):
        check_coverage(peft_model, targets)


def one_line_refusal(model: torch.nn.Module, lora: LoRAConfig, pattern: str) -> str:
    with pytest.raises(LoRAConfigError, match=pattern) as refused:
        check_lora_names(model, lora)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_mistyped_target_is_an_error_naming_the_closest_modules() -> None:
    lora = LoRAConfig(target_modules=["q_proj", "v_prj"])
    one_line_refusal(
        meta_model("llama", VOCAB),
        lora,
        r"^model\.lora\.target_modules: 'v_prj' matches no module of this model \(closest: v_proj, \w+\)$",
    )
    with pytest.raises(LoRAConfigError, match="'v_prj' matches no module"):  # the build refuses too
        attach_lora(tiny("llama"), LoRAConfig(r=4, target_modules=["q_proj", "v_prj"]))
    message = one_line_refusal(
        meta_model("llama", VOCAB), LoRAConfig(target_modules=["q_prj", "v_prj"]), "q_prj"
    )
    assert "'v_prj' matches no module" in message and "No `target_modules`" not in message


@pytest.mark.parametrize(
    ("lora", "pattern"),
    [
        (
            LoRAConfig(layers_to_transform=[0, 2, 7]),
            r"^model\.lora\.layers_to_transform: 2, 7 are not layers of this model \(its layers: 0-1\)$",
        ),
        (LoRAConfig(layers_to_transform=[]), r"^model\.lora\.layers_to_transform is empty"),
        (
            LoRAConfig(target_modules=["layers.0.self_attn.q_proj"], layers_to_transform=[1]),
            r"^model\.lora\.target_modules: 'layers\.0\.self_attn\.q_proj' matches no module within "
            r"model\.lora\.layers_to_transform \[1\]$",
        ),
        (
            LoRAConfig(rank_pattern={"q_prj": 8}),
            r"^model\.lora\.rank_pattern: 'q_prj' matches no targeted module of this model \(closest: q_proj",
        ),
        (
            LoRAConfig(alpha_pattern={"layers.1.mlp": 8.0}),
            r"^model\.lora\.alpha_pattern: 'layers\.1\.mlp' matches no targeted module",
        ),
        (
            LoRAConfig(target_modules=["q_proj"], rank_pattern={"v_proj": 8}),
            r"^model\.lora\.rank_pattern: 'v_proj' matches no targeted module",
        ),
        (
            LoRAConfig(rank_pattern={"q_proj[": 8}),
            r"^model\.lora\.rank_pattern: 'q_proj\[' is not a regular expression",
        ),
        (
            LoRAConfig(modules_to_save=["lm_haed"]),
            r"^model\.lora\.modules_to_save: 'lm_haed' matches no module of this model \(closest: lm_head\)$",
        ),
        (
            LoRAConfig(target_modules=["all-linear", "lm_head"]),
            r"^model\.lora\.target_modules: 'all-linear' matches no module.*stands alone",
        ),
    ],
)
def test_a_setting_that_names_nothing_in_the_model_is_an_error(lora, pattern) -> None:
    one_line_refusal(meta_model("llama", VOCAB), lora, pattern)


def test_a_pattern_key_that_misses_a_layer_adapted_through_its_weight_is_an_error() -> None:
    """peft matches rank and alpha keys against ``...gate_proj.weight`` for those: ``gate_proj`` would
    silently keep the default rank there."""
    one_line_refusal(
        meta_model("deepseek_v3", VOCAB),
        LoRAConfig(rank_pattern={"gate_proj": 8}),
        r"^model\.lora\.rank_pattern: 'gate_proj' does not reach model\.layers\.0\.mlp\.gate_proj, "
        r"model\.layers\.1\.mlp\.shared_experts\.gate_proj, adapted through its weight",
    )
    model = attach_lora(tiny("deepseek_v3"), LoRAConfig(r=4, rank_pattern={"gate_proj.weight": 8}))
    ranks = {n: p.shape[0] for n, p in model.named_parameters() if "lora_A" in n and "gate_proj" in n}
    assert len(ranks) == 2 and set(ranks.values()) == {8}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_valid_settings_pass_on_every_familys_meta_skeleton_without_a_forward(family) -> None:
    model = meta_model(family, VOCAB)
    assert all(p.device.type == "meta" for p in model.parameters())

    def no_forward(*_):
        raise AssertionError("check_lora_names ran a forward")

    model.register_forward_pre_hook(no_forward)
    check_lora_names(model, LoRAConfig())
    check_lora_names(model, LoRAConfig(layers_to_transform=[1], modules_to_save=["lm_head"]))


class Scaled(torch.nn.Linear):
    """A linear subclass whose forward is not its weight's linear map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class Routing(torch.nn.Linear):
    """A router we do not know: its forward returns a tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x)
        return logits, logits.topk(1, dim=-1).indices


def test_a_linear_subclass_with_a_plain_forward_is_adapted_and_trains() -> None:
    """Every Falcon layer is a ``FalconLinear`` (``input @ weight.T + bias``, a forward of its own)."""
    base = tiny("falcon")
    linears = [n for n, m in base.named_modules() if type(m).__name__ == "FalconLinear"]
    assert len(linears) == 8
    model = attach_lora(base, LoRAConfig(r=4))
    assert sorted(model.base_model.targeted_module_names) == sorted(linears)
    assert model.lora_coverage.line() == "LoRA: 8 of 8 linear layers"
    grads = lora_gradients_after_a_step(model)
    assert len(grads) == 16 and all(g is not None and g.abs().max() > 0 for g in grads.values())


def test_on_the_meta_device_a_linear_subclass_is_unprobed_and_the_build_probes_it() -> None:
    skeleton = meta_model("falcon", VOCAB)
    skeleton.transformer.h[1].mlp.dense_4h_to_h.__class__ = Scaled
    targets = lora_targets(skeleton, ["all-linear"], probe=False)
    assert len(targets.unprobed) == 8 and "transformer.h.1.mlp.dense_4h_to_h" in targets.unprobed
    assert "(8 linear subclasses taken for plain linear layers, unprobed: no weights)" in (
        LoRACoverage(targets, [], []).line()
    )
    check_lora_names(skeleton, LoRAConfig())  # no weights: taken as plain
    base = tiny("falcon")
    assert lora_targets(base, ["all-linear"]).unprobed == []
    base.transformer.h[1].mlp.dense_4h_to_h.__class__ = Scaled
    with pytest.raises(
        LoRAConfigError,
        match=r"^model\.lora\.target_modules: .*Scaled \(its output on a probe input "
        r"is not F\.linear\(x, weight, bias\)\): transformer\.h\.1\.mlp\.dense_4h_to_h\. Name",
    ):
        attach_lora(base, LoRAConfig(r=4))
    model = attach_lora(base, LoRAConfig(r=4, target_modules=["query_key_value"]))  # named around it
    assert model.lora_coverage.line() == "LoRA: 2 of 2 linear layers"


def test_an_unknown_linear_subclass_that_is_not_a_linear_map_is_refused_by_name() -> None:
    base = tiny("llama")
    base.model.layers[0].mlp.up_proj.__class__ = Routing
    with pytest.raises(
        LoRAConfigError,
        match=r"Routing \(its forward returns tuple, not the output of a linear "
        r"layer\): model\.layers\.0\.mlp\.up_proj\.",
    ):
        attach_lora(base, LoRAConfig(r=4))


def test_targets_that_leave_nothing_to_adapt_are_an_error_not_peft_s() -> None:
    """A known router named on its own is left out; nothing remains to adapt."""
    one_line_refusal(
        meta_model("llama4", VOCAB),
        LoRAConfig(target_modules=["router"]),
        r"^model\.lora\.target_modules: \['router'\] leave nothing to adapt \(left out: Llama4Router "
        r"\(its forward is not a plain linear layer: a router\) x2\)$",
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_linear_map_probe_holds_in_other_precisions(dtype) -> None:
    base = tiny("falcon").to(dtype)
    assert len(lora_targets(base, ["all-linear"], probe=False).modules) == 8
    base.transformer.h[0].self_attention.dense.__class__ = Scaled
    with pytest.raises(LoRAConfigError, match=r"Scaled \(its output on a probe input is not F\.linear"):
        lora_targets(base, ["all-linear"], probe=False)
