"""Packed attention in one varlen call (CUDA flash attention) instead of a loop over samples: the
dispatch, the window convention and the first-call check, run on CPU with a reference kernel that
follows flash attention's documented ``window_size=(left, right)`` semantics."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lit_instruct.models import packing
from lit_instruct.models.cpu_attention import packed_causal_attention
from lit_instruct.models.packing import packed_attention, varlen_applies

SEGMENTS = (0, 7, 10, 22, 23)


def reference_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """Flash attention's varlen contract on CPU: query ``i`` of a sequence sees keys ``j`` of the same
    sequence with ``i - left <= j <= i + right`` (a negative bound: unbounded)."""
    outputs = []
    left, right = window_size
    for s, e in itertools.pairwise(cu_q.tolist()):
        i, j = torch.arange(e - s)[:, None], torch.arange(e - s)[None, :]
        allowed = torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        heads = [t[s:e].transpose(0, 1) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


class Layer(torch.nn.Module):
    """What transformers' SDPA attention reads from a layer."""

    is_causal = True
    num_key_value_groups = 2


def qkv(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, SEGMENTS[-1], 8), (1, 2, SEGMENTS[-1], 8), (1, 2, SEGMENTS[-1], 8)]
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


@pytest.fixture
def cpu_varlen(monkeypatch):
    monkeypatch.setattr(packing, "VARLEN_DEVICES", {"cpu"})
    monkeypatch.setattr(packing, "_VARLEN_CHECKED", {})
    monkeypatch.setattr(packing, "varlen_kernel", lambda device: reference_varlen)


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_one_varlen_call_equals_the_per_sample_loop(cpu_varlen, window) -> None:
    query, key, value = qkv()
    kwargs = dict(scaling=0.3, dropout=0.0, sliding_window=window)
    fast, _ = packed_attention("sdpa")(Layer(), query, key, value, None, packed_segments=SEGMENTS, **kwargs)
    assert list(packing._VARLEN_CHECKED.values()) == [True]  # checked once, and used
    packing.VARLEN_DEVICES.clear()  # the loop
    loop, _ = packed_attention("sdpa")(Layer(), query, key, value, None, packed_segments=SEGMENTS, **kwargs)
    torch.testing.assert_close(fast.float(), loop.float(), atol=2e-2, rtol=0)
    assert fast.shape == (1, SEGMENTS[-1], 4, 8)


def test_a_kernel_that_disagrees_falls_back_to_the_loop_with_a_warning(cpu_varlen, monkeypatch) -> None:
    calls = []

    def off_by_one(*args, window_size=(-1, -1), **kwargs):  # a wrong window convention
        calls.append(window_size)
        left, right = window_size
        return reference_varlen(*args, window_size=(left + 1, right), **kwargs)

    monkeypatch.setattr(packing, "varlen_kernel", lambda device: off_by_one)
    query, key, value = qkv()
    attend = packed_attention("sdpa")
    with pytest.warns(UserWarning, match="differs from the per-sample loop"):
        out, _ = attend(Layer(), query, key, value, None, packed_segments=SEGMENTS, sliding_window=2)
    again, _ = attend(Layer(), query, key, value, None, packed_segments=SEGMENTS, sliding_window=2)
    assert len(calls) == 1  # once found wrong, the kernel is not called again for this configuration
    packing.VARLEN_DEVICES.clear()
    loop, _ = attend(Layer(), query, key, value, None, packed_segments=SEGMENTS, sliding_window=2)
    assert torch.equal(out, loop) and torch.equal(again, loop)


def test_varlen_only_where_it_reproduces_the_layer(monkeypatch) -> None:
    cpu, half = torch.zeros(1, dtype=torch.bfloat16), {"scaling": 0.1, "sliding_window": None}
    assert varlen_applies(cpu, half)
    assert not varlen_applies(cpu.float(), half)  # fp16/bf16 only: fp32 keeps SDPA's loop
    assert not varlen_applies(cpu, {**half, "dropout": 0.1})
    assert not varlen_applies(cpu, {**half, "softcap": 50.0})  # Gemma 2: the loop keeps it
    assert not varlen_applies(cpu, {**half, "s_aux": torch.zeros(1)})  # attention sinks
    assert varlen_applies(cpu, {**half, "softcap": None, "dropout": 0.0})
    monkeypatch.setattr(packing, "VARLEN_DEVICES", {"cuda"})
    assert not varlen_applies(cpu, half)  # no kernel on this device


@pytest.mark.parametrize("window", [None, 2, 5])
def test_the_varlen_arguments_are_exact_in_fp32(window) -> None:
    """The conversion to the varlen call (layout, cumulative lengths, window, GQA, scale) alone, in
    fp32 where the kernel contract is computed exactly: equal to the per-sample loop to 1e-5."""
    query, key, value = qkv(torch.float32)
    fast = packing.varlen_packed(query, key, value, SEGMENTS, window, 0.3, reference_varlen)
    loop, _ = packed_attention("sdpa")(
        Layer(), query, key, value, None, packed_segments=SEGMENTS, scaling=0.3, sliding_window=window
    )
    torch.testing.assert_close(fast, loop, atol=1e-5, rtol=1e-5)


# -- the CPU kernel (lit_instruct.models.cpu_attention) -------------------------------------------


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "window"), [(4, 2, None), (3, 3, None), (6, 2, 3), (4, 1, 100)]
)
def test_the_cpu_kernel_is_flash_attentions_contract(heads, kv_heads, window) -> None:
    """Outputs and q/k/v gradients equal the reference contract's: exact in float64 (1e-12), and in
    bf16 within 2e-2 of the float64 result (relative to each tensor's largest entry)."""
    gen = torch.Generator().manual_seed(1)
    total = SEGMENTS[-1]
    q, k, v = (
        torch.randn(total, h, 8, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(total, heads, 8, generator=gen, dtype=torch.float64)
    cumulative = torch.tensor(SEGMENTS)
    left = (-1 if window is None else window - 1, 0)
    args = (cumulative, cumulative, 0, 0)
    exact = _leaves((q, k, v), torch.float64)
    expected = reference_varlen(*exact, *args, scale=0.3, window_size=left, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, exact, grad)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        leaves = _leaves((q, k, v), dtype)
        out = packed_causal_attention(*leaves, *args, scale=0.3, window_size=left, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, grad.to(dtype))
        for ours, theirs in zip((out, *grads), (expected.detach(), *expected_grads), strict=True):
            assert ours.dtype == dtype
            scale = float(theirs.abs().max())
            torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=tolerance * scale)


def test_packed_bf16_attention_on_cpu_runs_the_kernel_after_its_check(monkeypatch) -> None:
    monkeypatch.setattr(packing, "_VARLEN_CHECKED", {})
    query, key, value = qkv(torch.bfloat16)
    out, _ = packed_attention("sdpa")(Layer(), query, key, value, None, packed_segments=SEGMENTS, scaling=0.3)
    assert list(packing._VARLEN_CHECKED.values()) == [True]
    monkeypatch.setattr(packing, "VARLEN_DEVICES", set())
    loop, _ = packed_attention("sdpa")(
        Layer(), query, key, value, None, packed_segments=SEGMENTS, scaling=0.3
    )
    torch.testing.assert_close(out.float(), loop.float(), rtol=0, atol=2e-2 * float(loop.float().abs().max()))


def test_the_cpu_kernel_on_sharp_attention_errs_at_most_twice_sdpas_own_bf16_error() -> None:
    """Logits up to ~35 (attention sinks of trained models): the packed kernel's scores are bf16
    GEMM outputs (fp32 scores cost a packed step ~7%), its output and q/k/v gradients within 2x SDPA's
    own bf16 error (+1e-3 of the largest entry) against float64."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(128, h, 64, generator=gen, dtype=torch.float64) for h in (9, 3, 3))
    q, k = q * 2.5, k * 2.5
    grad = torch.randn(128, 9, 64, generator=gen, dtype=torch.float64)
    cumulative = torch.tensor([0, 64, 128])

    def run(function, dtype):
        leaves = _leaves((q, k, v), dtype)
        out = function(*leaves)
        return [t.double() for t in (out.detach(), *torch.autograd.grad(out, leaves, grad.to(dtype)))]

    def sdpa(*tensors):
        return reference_varlen(
            *tensors, cumulative, cumulative, 64, 64, window_size=(-1, 0), enable_gqa=True
        )

    exact, theirs = run(sdpa, torch.float64), run(sdpa, torch.bfloat16)
    ours = run(
        lambda *t: packed_causal_attention(*t, cumulative, cumulative, 64, 64, enable_gqa=True),
        torch.bfloat16,
    )
    for o, t, e in zip(ours, theirs, exact, strict=True):
        assert float((o - e).abs().max()) <= 2 * float((t - e).abs().max()) + 1e-3 * float(e.abs().max())
