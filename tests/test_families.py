"""The support matrix: every family trains on its own loss, attention and LoRA targets.

For each tiny random model of ``tests/families.py``: the module's loss and LoRA gradients (reference,
fused torch, fused Triton under the interpreter) equal the model's own ``forward(labels=...)`` on the
same masked batch; packed training equals padded training (or packing is refused); LoRA lands on
every linear layer of the decoder; generation follows the same logits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.data.render import Sample
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.fused import FusedLinearCrossEntropy
from lit_instruct.loss.logits import IDENTITY
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.models.load import load_base_model
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.models.output_head import (
    OutputHead,
    UnsupportedModelError,
    check_against_model_logits,
    logit_transform,
    output_head,
)
from lit_instruct.train.module import InstructLoRAModule
from tests.families import (
    BY_WEIGHT,
    FAMILIES,
    LEFT_OUT,
    LINEAR_SUBCLASSES,
    MOE,
    NO_PACKING,
    SHARP,
    WINDOW,
    build_family,
    meta_model,
)

VOCAB = 49152
LOSSES = {
    "reference": reference_linear_cross_entropy,
    "fused_torch": FusedLinearCrossEntropy(chunk_size=8, backend="torch"),
    "fused_triton": FusedLinearCrossEntropy(chunk_size=8, backend="triton"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, InstructLoRAModule]:
    name = request.param
    path = build_family(name, VOCAB, tmp_path_factory.mktemp(name))
    module = InstructLoRAModule(model=str(path), lora=LoRAConfig(r=4, alpha=8), loss="reference")
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero B: both LoRA factors get gradients
        for param_name, p in module.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    return name, module


def samples() -> list[Sample]:
    """Two samples longer than the sliding window, answers masked the way the renderer masks."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for length, prompt in ((13, 6), (9, 3)):
        ids = torch.randint(5, VOCAB, (length,), generator=gen).tolist()
        out.append(Sample(ids, [IGNORE_INDEX] * prompt + ids[prompt:], "test"))
    return out


def assert_relatively_close(
    actual: torch.Tensor, expected: torch.Tensor, msg: str = "", tolerance: float = 1e-5
) -> None:
    """Equal to ``tolerance`` relative to the tensor's largest entry (fp32 rounding of reordered sums)."""
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale, msg=msg or None)


def lora_grads(module: InstructLoRAModule, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def own_loss(module: InstructLoRAModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return module.model(**batch, use_cache=False).loss


def our_loss(module: InstructLoRAModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The optimizer step's loss for one micro-batch: what ``training_step`` returns, / count."""
    sums = module.objective.sums(module, batch)  # the aux loss added here, as training_step adds it
    loss_sum, count, aux = sums.loss_sum, sums.count, sums.aux
    if aux is not None:
        loss_sum = loss_sum + module.router_aux_loss.coefficient * aux * count
    return loss_sum / count


def head_kind(model: torch.nn.Module) -> tuple[bool, bool, bool]:
    """What the fused loss's kernel sees of a family: a soft-cap, a scale, a bias on the lm_head."""
    head = output_head(model, verify=False)
    return head.transform.softcap is not None, head.transform.scale != 1.0, head.bias is not None


TRITON_FAMILIES = ("cohere", "gemma2", "llama", "phi")
"""One family per :func:`head_kind`: the Triton kernel takes the final hidden states, the lm_head and
its transform, so a family adds nothing to it beyond its head's kind (each family's own path up to the
hidden states is checked through the torch backend, the same chunking)."""


def test_the_triton_families_cover_every_kind_of_output_head() -> None:
    kinds = {name: head_kind(meta_model(name, VOCAB)) for name in FAMILIES}
    assert {kinds[name] for name in TRITON_FAMILIES} == set(kinds.values())
    assert len({kinds[name] for name in TRITON_FAMILIES}) == len(TRITON_FAMILIES)  # none twice


@pytest.mark.parametrize(
    ("family", "loss"),
    [
        pytest.param(name, loss, marks=pytest.mark.slow) if "triton" in loss else (name, loss)
        for name in sorted(FAMILIES)
        for loss in sorted(LOSSES)
        if loss != "fused_triton" or name in TRITON_FAMILIES
    ],
    indirect=["family"],
)
def test_loss_and_lora_gradients_equal_the_models_own(family, loss) -> None:
    name, module = family
    batch = PadCollator(0)(samples())
    expected = own_loss(module, batch)
    expected_grads = lora_grads(module, expected)
    module.loss_fn = LOSSES[loss]
    try:
        ours = our_loss(module, batch)
    finally:
        module.loss_fn = reference_linear_cross_entropy
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    tolerance = 1e-4 if name in SHARP else 1e-5
    for key, grad in lora_grads(module, ours).items():
        assert_relatively_close(grad, expected_grads[key], f"{name} {key}", tolerance)
    assert any(g.abs().max() > 0 for g in expected_grads.values())


def packed_twin(module: InstructLoRAModule) -> InstructLoRAModule:
    """The same model and adapter weights, built for packed rows."""
    twin = InstructLoRAModule(
        model=module.hparams.model, lora=LoRAConfig(r=4, alpha=8), packing=True, loss="reference"
    )
    twin.load_state_dict(module.state_dict())
    return twin


def test_the_config_check_knows_the_families_packing_refuses() -> None:
    """The model types refused from the config (no weights) are those the build check refuses."""
    from lit_instruct.models.packing import UNPACKABLE_MODEL_TYPES
    from tests.families import tiny_config

    refused = {name for name in FAMILIES if tiny_config(name, VOCAB).model_type in UNPACKABLE_MODEL_TYPES}
    assert refused == set(NO_PACKING)


def test_packed_equals_padded_or_is_refused(family) -> None:
    name, module = family
    if name in NO_PACKING:
        with pytest.raises(UnsupportedModelError, match=r"data\.packing: false"):
            packed_twin(module)
        with pytest.raises(ValueError, match="without packing=True"):
            module.loss_sum_and_count(PackCollator()(samples()))
        return
    twin = packed_twin(module)
    dtype = torch.float64 if name in SHARP else torch.float32
    module.to(dtype), twin.to(dtype)
    try:
        padded_sum, padded_count = module.loss_sum_and_count(PadCollator(0)(samples()))
        packed_sum, packed_count = twin.loss_sum_and_count(PackCollator()(samples()))
        padded, packed = lora_grads(module, padded_sum), lora_grads(twin, packed_sum)
    finally:
        module.float()
    assert packed_count == padded_count
    assert_relatively_close(packed_sum, padded_sum)
    for key, grad in packed.items():
        assert_relatively_close(grad, padded[key], f"{name} {key}")


def test_lora_lands_on_every_decoder_linear_layer_and_expert_weight(family) -> None:
    name, module = family
    base = load_base_model(module.hparams.model)
    head = base.get_output_embeddings()
    linears = [n for n, m in base.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not head]
    left_out = [n for n in linears if n.endswith(LEFT_OUT.get(name, ()))]
    experts = [
        f"{module_name}.{n}"
        for module_name, module in base.named_modules()
        if not isinstance(module, nn.Conv1d)
        for n, p in module.named_parameters(recurse=False)
        if p.dim() == 3
    ]
    adapted = [n for n, _ in module.model.named_modules() if n.endswith("lora_A")]
    assert len(adapted) == len(linears) - len(left_out) + len(experts)
    assert bool(experts) == (name in MOE)
    assert bool(left_out) == (name in LEFT_OUT)
    subclassed = [n for n in linears if type(base.get_submodule(n)).__name__ == LINEAR_SUBCLASSES.get(name)]
    assert bool(subclassed) == (name in LINEAR_SUBCLASSES)  # a forward of their own, adapted all the same
    assert not any("lm_head" in n for n in adapted)
    coverage = module.model.lora_coverage  # the build-time check counts the same
    assert not coverage.missing_modules and not coverage.missing_parameters
    by_weight = coverage.targets.by_weight  # layers named like the experts peft rewrites
    assert bool(by_weight) == (name in BY_WEIGHT)
    assert (len(coverage.targets.modules) + len(by_weight), len(coverage.targets.parameters)) == (
        len(linears) - len(left_out),
        len(experts),
    )


def test_generation_follows_the_training_logits(family) -> None:
    _, module = family
    module.eval()
    prompt = torch.tensor([samples()[0].input_ids[:7]])
    with torch.no_grad():
        generated = module.model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False
        )
        hidden = module.hidden_states({"input_ids": prompt})[0, -1]
        head = module.lm_head
        ours = module.logit_transform(nn.functional.linear(hidden, head.weight, head.bias))
    module.train()
    assert generated.shape == (1, 8)
    assert int(generated[0, 7]) == int(ours.argmax())


def test_a_post_head_step_it_does_not_know_is_refused() -> None:
    from transformers import LlamaForCausalLM

    class Shifted(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits - logits.mean(-1, keepdim=True)
            return logits

    with pytest.raises(UnsupportedModelError, match=r"Shifted.forward does `logits = logits - logits.mean"):
        logit_transform(Shifted.__new__(Shifted))


def test_sliding_window_matters_in_these_tests(family) -> None:
    """Guard against a vacuous matrix: the windowed families' samples are longer than the window."""
    name, module = family
    window = getattr(module.base_model.config, "sliding_window", None)
    if name in {"qwen2", "mistral", "phi3", "gemma2", "gemma3", "cohere2"}:
        assert window == WINDOW < min(len(s.input_ids) for s in samples())


def test_the_load_time_check_catches_a_dropped_logit_transform(family) -> None:
    _, module = family
    head = OutputHead(module.lm_head, IDENTITY)
    if module.logit_transform.is_identity:
        check_against_model_logits(module.base_model, head)  # nothing to drop: passes
        return
    with pytest.raises(UnsupportedModelError, match="differ from the model's own"):
        check_against_model_logits(module.base_model, head)


def test_unpacked_rows_keep_the_models_own_attention_once_packing_is_on(family) -> None:
    """With the packing wrapper installed, batches with no attention mask (generation, previews)
    still get the model's own causal and sliding-window masks."""
    name, module = family
    if name in NO_PACKING:
        return
    module = packed_twin(module).eval()
    own = load_base_model(module.hparams.model).eval()
    ids = torch.tensor([samples()[0].input_ids])
    with torch.no_grad(), module.model.disable_adapter():
        assert_relatively_close(module.model(input_ids=ids).logits, own(input_ids=ids).logits)
        kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert torch.equal(
            module.model.generate(input_ids=ids, **kwargs), own.generate(input_ids=ids, **kwargs)
        )


def test_the_documented_matrix_is_the_one_the_builds_write() -> None:
    from tests.support_matrix import MODELS_DOC, documented_matrix, matrix

    stale = "the support matrix of docs/models.md is stale: run `make matrix`"
    assert documented_matrix(MODELS_DOC.read_text()) == matrix(), stale


def test_a_multimodal_model_trains_its_language_model_on_text(tmp_path) -> None:
    """Gemma 3 with its vision tower: adapters go on the language model only (text batches never
    reach the tower), and the loss and LoRA gradients are the model's own."""
    import transformers

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    text |= dict(num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, final_logit_softcapping=0.5)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    vision |= dict(image_size=28, patch_size=14)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1
    )
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    module = InstructLoRAModule(model=str(tmp_path), lora=LoRAConfig(r=4, alpha=8))
    coverage = module.model.lora_coverage
    assert coverage.line().startswith("LoRA: 14 of 14 linear layers (left out: outside the language model")
    outside = next(iter(coverage.targets.left_out.values()))
    assert len(outside) == 9 and all(
        n.startswith(("model.vision_tower.", "model.multi_modal")) for n in outside
    )
    assert all(n.startswith("model.language_model.") for n in module.model.base_model.targeted_module_names)

    with torch.no_grad():
        for param_name, p in module.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    batch = PadCollator(0)(samples())
    expected = own_loss(module, batch)
    expected_grads = lora_grads(module, expected)
    ours = our_loss(module, batch)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    for key, grad in lora_grads(module, ours).items():
        assert_relatively_close(grad, expected_grads[key], key)
        assert grad.abs().max() > 0
