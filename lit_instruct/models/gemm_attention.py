"""SDPA of padded batches and of decoding on CPU in bf16/fp16, as batched GEMMs.

PyTorch's CPU SDPA kernels spend most of their time outside the matrix products at the shapes of
short rows (many completions of a prompt, preference pairs) and of decoding (one query against the
cache): there the same attention written as two batched GEMMs per layer (each KV head's query heads
stacked as rows, so GQA needs no copy of the keys), a mask and an fp32 softmax runs several times
faster. Backward recomputes the probabilities from q and k (as flash attention does): what is kept
is q, k, v and the output, never the ``(heads, queries, keys)`` probabilities.

:func:`gemm_sdpa_attention` has ``transformers``' attention-function contract and is registered
under :data:`GEMM_SDPA`; it takes the fast path only where it computes what
``sdpa_attention_forward`` computes (CPU, bf16/fp16, a boolean mask or causal, no dropout, no
soft-capping, sinks or position bias) and where it pays (:func:`pays`); everything else goes to
``sdpa_attention_forward`` itself. The first call of each configuration is checked against it, and
a mismatch falls back to it for good with a warning. Fully masked query rows give 0, as SDPA's.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lit_instruct.models.cpu_attention import attention_gradients, wide_dtype
from lit_instruct.precision import cpu_bf16

GEMM_SDPA = "lit_gemm_sdpa"
"""The registered name of :func:`gemm_sdpa_attention` (a model's ``sdpa`` is switched to it)."""

HALF_DTYPES = (torch.bfloat16, torch.float16)

LONGEST_TRAINING_KEYS = 160
"""Above this many keys a pass with several queries keeps PyTorch's flash kernel, whose softmax
work stays in cache where the ``(queries, keys)`` scores here do not (the crossover measured by
``benchmarks/attention_kernels.py`` lies between 160 and 256 keys)."""

NEUTRAL_KWARGS = frozenset(
    {"sliding_window", "position_ids", "use_cache", "cache_position", "output_attentions"}
)
"""Attention kwargs that do not change what SDPA computes (the mask carries the window; a set
``output_attentions`` only warns there); any other one that is set keeps SDPA."""


def _causal_blocked(queries: int, device: torch.device) -> torch.Tensor:
    """``(1, 1, queries, queries)``: True above the diagonal (SDPA's ``is_causal``). Built at each
    call: a cached one made under ``inference_mode`` could not be saved for backward later."""
    return torch.ones(queries, queries, dtype=torch.bool, device=device).triu(1)[None, None]


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, blocked: torch.Tensor | None, scale: float, group: int
) -> torch.Tensor:
    """Softmax ``(B, kv_heads, group * queries, keys)`` of stacked ``q`` against ``k`` in fp32 (fp64
    for fp64); rows with every key blocked are 0."""
    wide = wide_dtype(q.dtype)  # fp32 scores, as the flash kernel keeps them
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)).mul_(scale)
    if blocked is not None:
        batch, kv_heads, rows, keys = scores.shape
        scores.view(batch, kv_heads, group, rows // group, keys).masked_fill_(
            blocked[:, :, None], float("-inf")
        )
    probabilities = torch.softmax(scores, dim=-1)
    if blocked is not None:
        empty = blocked.all(-1, keepdim=True)  # queries that see no key: 0, as SDPA gives
        if bool(empty.any()):
            batch, kv_heads, rows, keys = probabilities.shape
            grouped = probabilities.view(batch, kv_heads, group, rows // group, keys)
            grouped.masked_fill_(empty[:, :, None], 0.0)
    return probabilities


class _GemmAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocked: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        batch, heads, queries, _ = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        stacked = q.reshape(batch, kv_heads, group * queries, q.shape[-1])
        probabilities = _probabilities(stacked, k, blocked, scale, group)
        out = torch.matmul(probabilities.to(q.dtype), v)
        ctx.save_for_backward(stacked, k, v, out, blocked)
        ctx.scale, ctx.group = scale, group
        return out.view(batch, heads, queries, v.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        stacked, k, v, out, blocked = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        grad_stacked = grad_out.reshape(out.shape)
        probabilities = _probabilities(stacked, k, blocked, scale, group)
        grad_q, grad_k, grad_v = attention_gradients(
            probabilities, stacked, k, v, out, grad_stacked, scale, wide_grad_p=True
        )
        return grad_q.view(grad_out.shape[0], -1, grad_out.shape[2], k.shape[-1]), grad_k, grad_v, None, None


def gemm_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``softmax(q k^T * scale, blocked -> -inf) v`` with fp32 softmax: ``q (B, heads, Lq, D)``,
    ``k``/``v`` ``(B, kv_heads, Lk, D)``, ``blocked`` a bool ``(B or 1, 1, Lq, Lk)`` (True: not
    seen) or None; returns ``(B, heads, Lq, Dv)``."""
    return _GemmAttention.apply(q, k, v, blocked, scale)


@functools.lru_cache(maxsize=1)
def _native_bf16() -> bool:
    return cpu_bf16()[0]


def pays(dtype: torch.dtype, queries: int, keys: int) -> bool:
    """Whether the GEMM path beats the flash kernel: decoding (one query) in bf16 or fp16, and rows
    of up to :data:`LONGEST_TRAINING_KEYS` keys in bf16 (fp16 GEMMs run far slower than SDPA on CPUs
    without native fp16), both only on CPUs that do bf16 natively."""
    if not _native_bf16():
        return False
    return queries == 1 or (dtype == torch.bfloat16 and keys <= LONGEST_TRAINING_KEYS)


def applies(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether this call is one the GEMM path computes as SDPA does, and faster."""
    if query.device.type != "cpu" or query.dtype not in HALF_DTYPES:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or query.shape[0] != key.shape[0]:
        return False
    if dropout or query.shape[1] % key.shape[1]:
        return False
    if attention_mask is not None and (
        attention_mask.dtype != torch.bool
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or attention_mask.shape[0] not in (1, query.shape[0])
        or attention_mask.shape[-2:] != (query.shape[2], key.shape[2])
    ):
        return False
    if attention_mask is None and query.shape[2] > key.shape[2]:  # SDPA's own corner: left to it
        return False
    if not all(value is None or value is False or name in NEUTRAL_KWARGS for name, value in kwargs.items()):
        return False
    return pays(query.dtype, query.shape[2], key.shape[2])


def _blocked(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: Any,
) -> tuple[torch.Tensor | None, int]:
    """SDPA's mask as blocked positions, and how many keys it sees (transformers drops the keys
    beyond the queries of a causal call with no mask)."""
    if attention_mask is not None:
        return ~attention_mask, key.shape[2]
    queries = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if queries > 1 and causal:
        return _causal_blocked(queries, query.device), queries
    return None, key.shape[2]


_CHECKED: dict[tuple[Any, ...], bool] = {}
"""Per configuration: whether the GEMM path matched ``sdpa_attention_forward``."""


def gemm_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward``, on CPU in bf16/fp16 as batched GEMMs where that is the same
    attention and faster; returns ``(B, Lq, heads, Dv)`` as it does."""

    def sdpa() -> tuple[torch.Tensor, None]:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )

    if not applies(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa()
    blocked, keys = _blocked(module, query, key, attention_mask, is_causal)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    config = (
        query.dtype,
        query.shape[1],
        key.shape[1],
        query.shape[-1],
        value.shape[-1],
        scale,
        query.shape[2] == 1,
        None if attention_mask is None else attention_mask.shape[0] == 1,
        blocked is None,
        keys < key.shape[2],
    )

    def fast() -> torch.Tensor:
        out = gemm_attention(query, key[:, :, :keys], value[:, :, :keys], blocked, scale)
        return out.transpose(1, 2).contiguous()

    if config not in _CHECKED:  # once per configuration, before any graph: SDPA is the reference
        with torch.no_grad():
            expected = sdpa()[0].float()
            error = float((fast().float() - expected).abs().max())
        _CHECKED[config] = error <= 2e-2 * max(float(expected.abs().max()), 1.0)
        if not _CHECKED[config]:
            warnings.warn(
                f"CPU GEMM attention differs from SDPA (max {error:.3g}) for {config}: using SDPA",
                stacklevel=2,
            )
    if not _CHECKED[config]:
        return sdpa()
    return fast(), None


def register_gemm_attention() -> None:
    """Register :func:`gemm_sdpa_attention` (and SDPA's mask) under :data:`GEMM_SDPA`."""
    AttentionInterface.register(GEMM_SDPA, gemm_sdpa_attention)
    AttentionMaskInterface.register(GEMM_SDPA, sdpa_mask)


def _reads_the_name(model: Any) -> bool:
    """Whether the model's own code compares its attention implementation with ``"sdpa"`` (Gemma 4's
    shared-KV layers, Falcon): renamed, it would take another branch."""
    import inspect
    import sys

    try:
        source = inspect.getsource(sys.modules[type(model).__module__])
    except (OSError, TypeError, KeyError):  # no source to read: assume it does
        return True
    return '"sdpa"' in source or "'sdpa'" in source


def use_gemm_attention(model: Any) -> bool:
    """Switch ``model``'s attention from ``sdpa`` to :data:`GEMM_SDPA`, where its family calls
    attention through ``transformers``' attention interface and never reads the name; anything else
    is left as it is. Returns whether it switched."""
    from lit_instruct.models.packing import attention_implementation

    if attention_implementation(model) != "sdpa" or not getattr(model, "_supports_attention_backend", False):
        return False
    if _reads_the_name(model):
        return False
    register_gemm_attention()
    try:
        model.set_attn_implementation(GEMM_SDPA)
    except (ValueError, ImportError):  # a sub-model that cannot take it: SDPA everywhere, as loaded
        model.set_attn_implementation("sdpa")
        return False
    return True
