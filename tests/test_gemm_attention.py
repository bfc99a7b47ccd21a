"""The CPU GEMM attention (lit_instruct.models.gemm_attention) against SDPA: the kernel exact in
float64 and within bf16's tolerance, its dispatch (fast path only where it is SDPA's computation),
and whole models of the windowed/QK-normed/GQA families on padded rows and while decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lit_instruct.models import gemm_attention
from lit_instruct.models.gemm_attention import GEMM_SDPA, gemm_sdpa_attention
from lit_instruct.models.gemm_attention import gemm_attention as kernel
from lit_instruct.models.load import load_base_model
from lit_instruct.models.packing import attention_implementation
from lit_instruct.precision import cpu_bf16
from tests.families import tiny_model

NATIVE_BF16 = cpu_bf16()[0]


def _allowed(batch: int, queries: int, keys: int, starts: list[int], ends: list[int]) -> torch.Tensor:
    """transformers' padded causal mask ``(B, 1, Lq, Lk)``: key ``j`` of row ``b`` is seen from query
    ``i`` (the last ``queries`` positions) iff ``starts[b] <= j < ends[b]`` and ``j <= i``."""
    i = torch.arange(keys - queries, keys)[:, None]
    j = torch.arange(keys)[None, :]
    rows = [(j >= s) & (j < e) & (j <= i) for s, e in zip(starts, ends, strict=True)]
    return torch.stack(rows)[:, None]


MASKS = {
    # left padding (pad queries see nothing: SDPA gives 0), right padding, both, decoding, none
    "left": (3, 9, 9, [0, 4, 2], [9, 9, 9]),
    "right": (3, 9, 9, [0, 0, 0], [9, 5, 7]),
    "both": (3, 9, 9, [3, 0, 1], [7, 9, 6]),
    "decode": (3, 1, 12, [0, 5, 2], [12, 12, 12]),
}


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize("case", MASKS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)])
def test_the_kernel_is_sdpa_exact_in_float64_and_within_bf16s_tolerance(case, heads, kv_heads) -> None:
    """Outputs and q/k/v gradients against SDPA in float64: 1e-12 in float64, 2e-2 of each tensor's
    largest entry in bf16; a query that sees no key gives 0, as SDPA's."""
    batch, queries, keys, starts, ends = MASKS[case]
    allowed = _allowed(batch, queries, keys, starts, ends)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(batch, h, n, 16, generator=gen, dtype=torch.float64)
        for h, n in ((heads, queries), (kv_heads, keys), (kv_heads, keys))
    )
    grad = torch.randn(batch, heads, queries, 16, generator=gen, dtype=torch.float64)
    exact = _leaves((q, k, v), torch.float64)
    expected = F.scaled_dot_product_attention(*exact, attn_mask=allowed, scale=0.3, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, exact, grad)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        leaves = _leaves((q, k, v), dtype)
        out = kernel(*leaves, ~allowed, 0.3)
        grads = torch.autograd.grad(out, leaves, grad.to(dtype))
        for ours, theirs in zip((out, *grads), (expected.detach(), *expected_grads), strict=True):
            assert ours.dtype == dtype
            torch.testing.assert_close(
                ours.double(), theirs, rtol=0, atol=tolerance * float(theirs.abs().max())
            )
    if case in ("left", "both"):  # the first query of the row padded most on the left sees nothing
        row = starts.index(max(starts))
        assert not expected.detach()[row, :, 0].any() and not out.detach()[row, :, 0].any()


class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _qkv(dtype: torch.dtype, queries: int = 9, keys: int = 9):
    gen = torch.Generator().manual_seed(5)
    shapes = ((2, 4, queries, 16), (2, 2, keys, 16), (2, 2, keys, 16))
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]


@pytest.mark.skipif(not NATIVE_BF16, reason="the GEMM path runs where the CPU does bf16 natively")
def test_bf16_attention_takes_the_gemm_path_after_one_check_against_sdpa(monkeypatch) -> None:
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    calls = []
    monkeypatch.setattr(gemm_attention, "gemm_attention", lambda *a: calls.append(1) or kernel(*a))
    query, key, value = _qkv(torch.bfloat16)
    for mask in (None, _allowed(2, 9, 9, [0, 3], [9, 9])):
        ours, _ = gemm_sdpa_attention(Layer(), query, key, value, mask, scaling=0.3)
        theirs, _ = sdpa_attention_forward(Layer(), query, key, value, mask, scaling=0.3)
        assert ours.shape == theirs.shape == (2, 9, 4, 16)
        torch.testing.assert_close(
            ours.float(), theirs.float(), rtol=0, atol=2e-2 * float(theirs.abs().max())
        )
    assert len(calls) == 4 and list(gemm_attention._CHECKED.values()) == [True, True]  # checked, then run
    gemm_sdpa_attention(Layer(), query, key, value, None, scaling=0.3)
    assert len(calls) == 5  # checked once


@pytest.mark.parametrize(
    "setting",
    ["fp32", "fp16 rows", "float mask", "dropout", "softcap", "long rows"],
)
def test_every_other_call_is_sdpas_own(setting, monkeypatch) -> None:
    """fp32, fp16 training rows, additive masks, dropout, soft-capping, rows longer than the GEMM
    path pays for: SDPA's own output, bit for bit."""
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    dtype = {"fp32": torch.float32, "fp16 rows": torch.float16}.get(setting, torch.bfloat16)
    length = gemm_attention.LONGEST_TRAINING_KEYS + 1 if setting == "long rows" else 9
    query, key, value = _qkv(dtype, length, length)
    mask = _allowed(2, length, length, [0, 3], [length, length])
    kwargs: dict = {"scaling": 0.3}
    if setting == "float mask":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    if setting == "dropout":
        kwargs["dropout"] = 0.5
    if setting == "softcap":
        with pytest.raises(ValueError, match="softcap"):
            gemm_sdpa_attention(Layer(), query, key, value, mask, softcap=1.0, **kwargs)
        return
    torch.manual_seed(0)
    ours, _ = gemm_sdpa_attention(Layer(), query, key, value, mask, **kwargs)
    torch.manual_seed(0)
    theirs, _ = sdpa_attention_forward(Layer(), query, key, value, mask, **kwargs)
    assert torch.equal(ours, theirs)
    assert not gemm_attention._CHECKED


def test_a_checked_mismatch_falls_back_to_sdpa_with_a_warning(monkeypatch) -> None:
    if not NATIVE_BF16:
        pytest.skip("the GEMM path runs where the CPU does bf16 natively")
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    monkeypatch.setattr(gemm_attention, "gemm_attention", lambda *a: kernel(*a) + 1.0)
    query, key, value = _qkv(torch.bfloat16)
    with pytest.warns(UserWarning, match="differs from SDPA"):
        ours, _ = gemm_sdpa_attention(Layer(), query, key, value, None, scaling=0.3)
    assert torch.equal(ours, sdpa_attention_forward(Layer(), query, key, value, None, scaling=0.3)[0])
    assert list(gemm_attention._CHECKED.values()) == [False]
    calls = []
    monkeypatch.setattr(gemm_attention, "gemm_attention", lambda *a: calls.append(1) or kernel(*a))
    again, _ = gemm_sdpa_attention(Layer(), query, key, value, None, scaling=0.3)  # for good: not tried again
    assert torch.equal(again, ours) and not calls


def _as(model: torch.nn.Module, implementation: str, dtype: torch.dtype) -> torch.nn.Module:
    gemm_attention.register_gemm_attention()
    model = model.to(dtype)
    model.set_attn_implementation(implementation)
    return model


@pytest.mark.skipif(not NATIVE_BF16, reason="the GEMM path runs where the CPU does bf16 natively")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3", "qwen3"])
def test_a_models_padded_rows_and_decoding_stay_within_sdpas_bf16_error(
    family, tokenizer, monkeypatch
) -> None:
    """A bf16 model on left-padded rows and one decoding step with its cache: the logits of the real
    positions through the GEMM path are as close to the float64 model's as SDPA's own bf16 logits
    are (at most 1.5x SDPA's error, plus 1e-2 of the largest logit), and the input gradients too."""
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    real = mask.bool()
    runs = {}
    for name, implementation, dtype in (
        ("exact", "sdpa", torch.float64),
        ("sdpa", "sdpa", torch.bfloat16),
        ("gemm", GEMM_SDPA, torch.bfloat16),
    ):
        model = _as(tiny_model(family, 256), implementation, dtype)
        model.config.use_cache = True
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        out = model(inputs_embeds=embeds[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        step = model(
            inputs_embeds=embeds[:, -1:],
            attention_mask=mask,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        logits = torch.cat([out.logits, step.logits], dim=1)
        (grad,) = torch.autograd.grad(logits[real].float().logsumexp(-1).sum(), embeds)
        runs[name] = (logits[real].detach().double(), grad[real].double())
    for index in range(2):
        exact = runs["exact"][index]
        sdpa_error = float((runs["sdpa"][index] - exact).abs().max())
        gemm_error = float((runs["gemm"][index] - exact).abs().max())
        assert gemm_error <= 1.5 * sdpa_error + 1e-2 * float(exact.abs().max()), (
            index,
            gemm_error,
            sdpa_error,
        )
    decoding = {config[6] for config in gemm_attention._CHECKED}  # both passes took the GEMM path
    assert decoding == {True, False} and all(gemm_attention._CHECKED.values())


def test_loading_switches_sdpa_to_the_gemm_path_and_nothing_else(tiny_model_dir, tmp_path) -> None:
    """``sdpa`` (transformers' default) becomes :data:`GEMM_SDPA`; an explicit ``eager`` stays; a saved
    model carries no trace of it (it loads back as ``sdpa`` anywhere)."""
    from transformers import AutoModelForCausalLM

    model = load_base_model(str(tiny_model_dir))
    assert attention_implementation(model) == GEMM_SDPA
    assert (
        attention_implementation(load_base_model(str(tiny_model_dir), attn_implementation="eager")) == "eager"
    )
    model.save_pretrained(tmp_path / "saved")
    assert GEMM_SDPA not in (tmp_path / "saved" / "config.json").read_text()
    assert attention_implementation(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")) == "sdpa"


def test_sharp_attention_stays_within_sdpas_own_bf16_error() -> None:
    """Logits up to ~35 (attention sinks in trained models): the scores and ``dO V^T`` are fp32 as in
    the flash kernel, so the GEMM path's bf16 output and q/k/v gradients err at most 1.5x SDPA's own
    bf16 error (+1e-3 of the largest entry) against float64."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(4, h, 64, 64, generator=gen, dtype=torch.float64) for h in (6, 2, 2))
    q, k = q * 2.5, k * 2.5  # q.k / 8 up to ~35
    grad = torch.randn(4, 6, 64, 64, generator=gen, dtype=torch.float64)
    blocked = torch.ones(64, 64, dtype=torch.bool).triu(1)[None, None]

    def run(function, dtype):
        leaves = _leaves((q, k, v), dtype)
        out = function(*leaves)
        return [t.double() for t in (out.detach(), *torch.autograd.grad(out, leaves, grad.to(dtype)))]

    def sdpa(*t):
        return F.scaled_dot_product_attention(*t, attn_mask=~blocked, enable_gqa=True)

    exact = run(sdpa, torch.float64)
    theirs = run(sdpa, torch.bfloat16)
    ours = run(lambda *t: kernel(*t, blocked, 64**-0.5), torch.bfloat16)
    for o, t, e in zip(ours, theirs, exact, strict=True):
        scale = float(e.abs().max())
        assert float((o - e).abs().max()) <= 1.5 * float((t - e).abs().max()) + 1e-3 * scale


def test_a_nan_propagates_and_only_queries_that_see_nothing_are_zero() -> None:
    allowed = _allowed(2, 6, 6, [2, 0], [6, 6])
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.bfloat16) for _ in range(3))
    q[1, 0, 3] = float("nan")
    out = kernel(q, k, v, ~allowed, 0.3)
    assert out[1, 0, 3].isnan().all() and not out[1, 0, :3].isnan().any()
    assert not out[0, :, :2].any() and out[0, :, 2:].abs().sum() > 0  # left padding: 0, as SDPA's


def test_second_order_gradients_are_refused() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = kernel(q, k, v, None, 0.3)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        grad_q.sum().backward()


@pytest.mark.skipif(not NATIVE_BF16, reason="the GEMM path runs where the CPU does bf16 natively")
@pytest.mark.parametrize("case", ["shared mask", "cache crop", "not causal", "other value dim"])
def test_the_corners_of_sdpas_contract(case, monkeypatch) -> None:
    """A mask shared by the batch, a causal call with more keys than queries (transformers keeps the
    first ones), a non-causal layer with no mask, values wider than keys: SDPA's output."""
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    layer = Layer()
    query, key, value = _qkv(torch.bfloat16, 7, 11 if case == "cache crop" else 7)
    mask = _allowed(1, 7, 7, [2], [7]) if case == "shared mask" else None
    if case == "not causal":
        layer.is_causal = False
    if case == "other value dim":
        value = torch.randn(2, 2, 7, 24).to(torch.bfloat16)
    ours, _ = gemm_sdpa_attention(layer, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=2e-2 * float(theirs.abs().max()))
    assert list(gemm_attention._CHECKED.values()) == [True]


def test_a_causal_mask_built_in_inference_mode_does_not_reach_training(monkeypatch) -> None:
    """Validation runs under ``inference_mode``; the next training call of the same length still
    saves its mask for backward."""
    monkeypatch.setattr(gemm_attention, "_CHECKED", {})
    query, key, value = _qkv(torch.bfloat16)
    with torch.inference_mode():
        gemm_sdpa_attention(Layer(), query, key, value, None, scaling=0.3)
    leaves = _leaves((query, key, value), torch.bfloat16)
    out, _ = gemm_sdpa_attention(Layer(), *leaves, None, scaling=0.3)
    out.float().sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_families_that_read_the_name_or_bypass_the_interface_keep_sdpa() -> None:
    """Gemma 4 compares its implementation with "sdpa" in its shared-KV layers, Falcon calls SDPA
    itself: both stay on SDPA, as a family whose code cannot be read does."""
    from lit_instruct.models.gemm_attention import use_gemm_attention

    for family, switched in (("llama", True), ("gemma4", False), ("falcon", False)):
        model = tiny_model(family, 256)
        assert use_gemm_attention(model) is switched, family
        assert attention_implementation(model) == (GEMM_SDPA if switched else "sdpa"), family
