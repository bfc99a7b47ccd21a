"""Causal attention of packed samples on CPU in bf16/fp16: batched GEMMs per sample, recomputed in
backward.

PyTorch's CPU SDPA kernel runs bf16 no faster than fp32 at the lengths of instruction samples (a
SmolLM2 layer on 4 samples of 275 tokens, forward and backward: 30 ms in bf16, 25 in fp32), while
the same attention written as matmuls runs its GEMMs at the bf16 rate (14 ms). Here each sample's
scores are one batched GEMM over its KV heads (the query heads sharing a KV head stacked as rows),
the mask and softmax are fp32, and backward recomputes the probabilities (as flash attention does):
what is kept for backward is q, k, v and the output, not the ``(heads, n, n)`` probabilities of
eager attention.

:func:`packed_causal_attention` has the calling convention of ``torch.nn.attention.varlen``'s
``varlen_attn``, so that :mod:`lit_instruct.models.packing` uses it where that runs on CUDA, with
the same once-per-configuration check against the per-sample loop.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch


@functools.lru_cache(maxsize=64)
def _blocked(n: int, window: int | None, group: int) -> torch.Tensor:
    """``(group * n, n)``: True where query ``i`` (each of ``group`` stacked heads) may not see key
    ``j``: ``j > i`` or, with a window, ``j <= i - window``."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    blocked = j > i
    if window is not None:
        blocked |= j <= i - window
    return blocked.repeat(group, 1)


def _stacked(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(n, heads, D)`` -> ``(kv_heads, heads // kv_heads * n, D)``: each KV head's query heads as rows."""
    n, heads, dim = x.shape
    return x.permute(1, 0, 2).reshape(kv_heads, heads // kv_heads * n, dim)


def _unstacked(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_stacked`: ``(n, heads, D)``."""
    kv_heads, rows, dim = x.shape
    return x.reshape(heads, rows * kv_heads // heads, dim).permute(1, 0, 2)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The softmax's dtype: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def attention_gradients(
    probabilities: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    wide_grad_p: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of stacked ``q`` (``(..., rows, D)``), ``k`` and ``v`` (``(..., n, D)``) of
    ``out = probabilities @ v``, ``probabilities = softmax(scale * q k^T + mask)``, given the
    (recomputed, wide) ``probabilities``, which this overwrites. ``dO V^T`` is a GEMM in the wide
    dtype with ``wide_grad_p``, else in the inputs' dtype and widened after."""
    wide = probabilities.dtype
    grad_v = torch.matmul(probabilities.to(v.dtype).transpose(-1, -2), grad_out)
    if wide_grad_p:
        grad_p = torch.matmul(grad_out.to(wide), v.to(wide).transpose(-1, -2))
    else:
        grad_p = torch.matmul(grad_out, v.transpose(-1, -2)).to(wide)
    rowwise = (grad_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)
    grad_scores = probabilities.mul_(grad_p.sub_(rowwise)).mul_(scale).to(q.dtype)
    return torch.matmul(grad_scores, k), torch.matmul(grad_scores.transpose(-1, -2), q), grad_v


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Softmax probabilities ``(kv_heads, rows, n)`` (fp32, or fp64 for fp64 inputs) of stacked ``q``
    against ``k`` ``(kv_heads, n, D)``."""
    scores = torch.bmm(q, k.transpose(1, 2)).to(wide_dtype(q.dtype)).mul_(scale)
    scores.masked_fill_(_blocked(k.shape[1], window, q.shape[1] // k.shape[1]), float("-inf"))
    return torch.softmax(scores, dim=-1)


class _PackedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: tuple[int, ...],
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        heads, kv_heads = q.shape[1], k.shape[1]
        out = torch.empty_like(q)
        for s, e in itertools.pairwise(segments):
            qs, ks, vs = _stacked(q[s:e], kv_heads), _stacked(k[s:e], kv_heads), _stacked(v[s:e], kv_heads)
            probabilities = _probabilities(qs, ks, scale, window)
            out[s:e] = _unstacked(torch.bmm(probabilities.to(q.dtype), vs), heads)
        ctx.save_for_backward(q, k, v, out)
        ctx.segments, ctx.scale, ctx.window = segments, scale, window
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out = ctx.saved_tensors
        heads, kv_heads, scale = q.shape[1], k.shape[1], ctx.scale
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for s, e in itertools.pairwise(ctx.segments):
            qs, ks, vs = _stacked(q[s:e], kv_heads), _stacked(k[s:e], kv_heads), _stacked(v[s:e], kv_heads)
            grad_os, os = _stacked(grad_out[s:e], kv_heads), _stacked(out[s:e], kv_heads)
            probabilities = _probabilities(qs, ks, scale, ctx.window)
            grads = attention_gradients(probabilities, qs, ks, vs, os, grad_os, scale, wide_grad_p=False)
            grad_q[s:e] = _unstacked(grads[0], heads)
            grad_k[s:e] = _unstacked(grads[1], kv_heads)
            grad_v[s:e] = _unstacked(grads[2], kv_heads)
        return grad_q, grad_k, grad_v, None, None, None


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None = None,
    window_size: Sequence[int] = (-1, 0),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``varlen_attn``'s contract on CPU: ``q (T, heads, D)``, ``k``/``v`` ``(T, kv_heads, D)``, the
    samples' bounds ``cu_seq_q`` (equal to ``cu_seq_k``: self-attention), causal with a left window
    of ``window_size[0]`` keys (-1: none); returns ``(T, heads, D)``."""
    segments = tuple(int(x) for x in cu_seq_q.tolist())
    left = int(window_size[0])
    window = None if left < 0 else left + 1  # transformers' window w is flash's left window w - 1
    return _PackedCausalAttention.apply(q, k, v, segments, scale or q.shape[-1] ** -0.5, window)
