"""Padding-free packing: a micro-batch's samples in one row, with attention kept inside each sample.

:class:`~lit_instruct.data.collate.PackCollator` concatenates the samples and records their
boundaries as ``packed_segments``. The module hands them to the decoder, whose attention is
:func:`packed_attention` around the model's own attention function (SDPA, or the family's eager
one): it runs sample by sample, each with the mask the model would give it alone (causal, and the
layer's sliding window), and with everything else the layer passes (scaling, soft-capping, sinks),
so no FLOP or byte is spent on attention across samples (a block-diagonal mask would cost the square
of the whole row). Unpacked batches go straight to the model's attention function (SDPA through
:mod:`lit_instruct.models.gemm_attention`).

In fp16/bf16, SDPA models whose layers pass nothing but scaling, dropout 0 and a sliding window run
all samples in one variable-length call instead of one SDPA call per sample: flash attention's
(``torch.nn.attention.varlen``) on CUDA, :mod:`lit_instruct.models.cpu_attention` on CPU (bf16
GEMMs, where the CPU SDPA kernel runs bf16 at fp32's speed). The first such call for each
configuration is checked against the per-sample loop, and a mismatch falls back to the loop with a
warning.
"""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from lit_instruct.models.decoder import decoder_of
from lit_instruct.models.gemm_attention import GEMM_SDPA, gemm_sdpa_attention

UNPACKABLE_MODEL_TYPES = {
    **dict.fromkeys(
        ("falcon_h1", "granitemoehybrid", "jamba", "bamba", "nemotron_h", "zamba2", "mamba", "mamba2"),
        "carries Mamba state from token to token",
    ),
    "falcon_mamba": "carries Mamba state from token to token",
    "qwen3_next": "carries delta-net state from token to token",
    "qwen3_5_text": "carries delta-net state from token to token",
    "qwen3_5": "carries delta-net state from token to token",
    "lfm2": "mixes neighbouring tokens in its short convolutions",
    "llama4_text": "applies its attention chunks through the mask",
    "phimoe": "applies its sliding window through the mask",
}
"""Model types whose packed rows the build check refuses (their layers mix tokens across samples
other than through attention), refused from the config before any weights are read; the build
check stays the guard for every other model."""

PACKED_ATTENTION = {"sdpa": "lit_packed_sdpa", "eager": "lit_packed_eager"}
"""The model's attention implementation -> its packing-aware wrapper (registered in transformers)."""


def _model_eager_attention(module: torch.nn.Module) -> Callable[..., Any]:
    """The eager attention function of the module's own family (Gemma 2's soft-caps, etc.)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise TypeError(f"{type(module).__module__} defines no eager_attention_forward to pack with")
    return function


def sample_mask(
    queries: int,
    keys: int,
    sliding_window: int | None,
    additive: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The ``(1, 1, queries, keys)`` mask of one sample alone, its queries being the last positions:
    key ``j`` is seen from query ``i`` iff ``i - window < j <= i`` (transformers' causal and
    sliding-window rule). ``None`` where SDPA's own causal flag is the same mask; an additive float
    mask for eager attention."""
    if not additive and queries == keys and (sliding_window is None or keys <= sliding_window):
        return None
    i = torch.arange(keys - queries, keys, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    if not additive:
        return allowed[None, None]
    blocked = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return blocked[None, None]


VARLEN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "is_causal", "position_ids", "use_cache"})
"""The attention kwargs the varlen path reproduces (dropout only at 0; ``use_cache`` is the caller's
and does not change attention); any other one that is set (soft-capping, sinks, ...) keeps the
per-sample loop."""


def varlen_kernel(device_type: str) -> Callable[..., Any] | None:
    """The variable-length attention for ``device_type``: ``torch.nn.attention.varlen.varlen_attn``
    on CUDA where this torch has it, :func:`~lit_instruct.models.cpu_attention.packed_causal_attention`
    on CPU."""
    if device_type == "cpu":
        from lit_instruct.models.cpu_attention import packed_causal_attention

        return packed_causal_attention
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


VARLEN_DEVICES = {"cuda", "cpu"}
"""Device types with a varlen kernel."""


def varlen_applies(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the packed samples of this call may run as one varlen call."""
    if query.device.type not in VARLEN_DEVICES or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if kwargs.get("dropout"):
        return False
    return all(value is None or name in VARLEN_KWARGS for name, value in kwargs.items())


@functools.lru_cache(maxsize=8)
def _cumulative(segments: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(segments, dtype=torch.int32, device=device)


def varlen_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Sequence[int],
    window: int | None,
    scaling: float | None,
    kernel: Callable[..., Any],
) -> torch.Tensor:
    """All packed samples in one varlen call: ``(1, heads, T, D)`` in, ``(1, T, heads, D)`` out, each
    sample causal (and windowed: transformers' ``i - w < j <= i`` is flash's left window ``w - 1``)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D)
    cumulative = _cumulative(tuple(segments), query.device)
    longest = max(e - s for s, e in itertools.pairwise(segments))
    out = kernel(
        q,
        k,
        v,
        cumulative,
        cumulative,
        longest,
        longest,
        scale=scaling,
        window_size=(-1, 0) if window is None else (window - 1, 0),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[None]


_VARLEN_CHECKED: dict[tuple[Any, ...], bool] = {}
"""Per configuration (window, dtype, head dims): whether varlen matched the per-sample loop."""


def packed_attention(inner: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """A ``transformers`` attention function that runs ``inner`` (``sdpa`` or ``eager``) on each
    packed sample separately, and as is on unpacked batches."""
    additive = inner == "eager"

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        packed_segments: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        function = _model_eager_attention(module) if additive else sdpa_attention_forward
        window = kwargs.get("sliding_window")
        if packed_segments is None:
            if attention_mask is None:  # the mask was skipped (see _packed_mask): one unpadded row
                attention_mask = sample_mask(
                    query.shape[2], key.shape[2], window, additive, query.dtype, query.device
                )
            unpacked = function if additive else gemm_sdpa_attention
            return unpacked(module, query, key, value, attention_mask, **kwargs)
        kwargs.pop("is_causal", None)

        def per_sample() -> torch.Tensor:
            outputs = []
            for s, e in itertools.pairwise(packed_segments):
                mask = sample_mask(e - s, e - s, window, additive, query.dtype, query.device)
                causal: dict[str, Any] = {"is_causal": True} if mask is None else {}
                q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
                outputs.append(function(module, q, k, v, mask, **causal, **kwargs)[0])
            return torch.cat(outputs, dim=1)  # (1, T, heads, head_dim)

        kernel = varlen_kernel(query.device.type)
        if additive or kernel is None or not varlen_applies(query, kwargs):
            return per_sample(), None
        config = (window, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
        if _VARLEN_CHECKED.get(config) is False:
            return per_sample(), None
        fast = varlen_packed(query, key, value, packed_segments, window, kwargs.get("scaling"), kernel)
        if config not in _VARLEN_CHECKED:  # once per configuration: the loop is the reference
            with torch.no_grad():
                expected = per_sample()
                error = float((fast.detach().float() - expected.float()).abs().max())
                scale = float(expected.float().abs().max())
            _VARLEN_CHECKED[config] = error <= 2e-2 * max(scale, 1.0)
            if not _VARLEN_CHECKED[config]:
                warnings.warn(
                    f"varlen packed attention differs from the per-sample loop (max {error:.3g}) for "
                    f"{config}: using the loop",
                    stacklevel=2,
                )
                return per_sample(), None
        return fast, None

    return attention


def _packed_mask(inner: Callable[..., Any]) -> Callable[..., Any]:
    """No mask for packed rows (each sample gets its own); the inner implementation's otherwise."""

    def mask(**kwargs: Any) -> Any:
        return None if kwargs.get("attention_mask") is None else inner(**kwargs)

    return mask


def register_packed_attention() -> None:
    """Register the packing-aware wrappers in ``transformers``' attention and mask registries under
    the names of :data:`PACKED_ATTENTION` (again on each call: the same entries; :func:`enable_packing`
    calls it)."""
    for inner, name in PACKED_ATTENTION.items():
        AttentionInterface.register(name, packed_attention(inner))
        AttentionMaskInterface.register(name, _packed_mask(sdpa_mask if inner == "sdpa" else eager_mask))


def attention_implementation(model: Any) -> str:
    """The model's attention implementation (``sdpa``, ``eager``, ...).

    The one private read of ``transformers`` in lit-instruct: version 5 sets it with the public
    ``set_attn_implementation`` but has no public getter. ``tests/test_packing.py`` checks that the
    two agree, so a change in ``transformers`` fails there first.
    """
    return model.config._attn_implementation


WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")
"""Config fields that bound how far attention reaches (a sliding window, Llama 4's chunks)."""


def check_lengths(model: Any) -> tuple[int, int]:
    """Lengths of the two samples of the build check: each longer than every attention window the
    config names (a model that applies its window through the mask alone, not through the attention
    call's arguments, passes a check on shorter rows and packs longer ones wrongly), within the
    model's context."""
    config = model.config.get_text_config()
    fields = WINDOW_FIELDS if getattr(config, "use_sliding_window", True) else WINDOW_FIELDS[1:]  # Qwen2
    windows = [getattr(config, field, None) for field in fields]
    window = max((w for w in windows if isinstance(w, int) and w > 0), default=2)
    context = getattr(config, "max_position_embeddings", None) or window + 3
    return min(window + 3, context), min(window + 1, context)


@torch.no_grad()
def enable_packing(model: Any, lengths: Sequence[int] | None = None, check: bool = True) -> None:
    """Switch ``model`` to the packing-aware wrapper of its attention, after checking (eval mode)
    that a packed row of two samples, each longer than any attention window of the model
    (:func:`check_lengths`), gives the hidden states of the samples run alone through the model's
    own attention, so that nothing but attention mixes tokens across samples.

    Raises:
        UnsupportedModelError: naming the model, when its attention implementation cannot run per
            sample or packing would change its output (the model is left as it was).
    """
    from lit_instruct.models.output_head import UnsupportedModelError

    own = attention_implementation(model)
    if own in PACKED_ATTENTION.values():
        return
    name = type(model).__name__
    inner = "sdpa" if own == GEMM_SDPA else own
    if inner not in PACKED_ATTENTION:
        raise UnsupportedModelError(
            f"data.packing needs model.attn_implementation sdpa or eager, not {own!r}"
        )
    register_packed_attention()
    if not check:  # a weightless (meta) copy of a model checked elsewhere
        model.set_attn_implementation(PACKED_ATTENTION[inner])
        return
    decoder = decoder_of(model)
    device = next(model.parameters()).device
    lengths = lengths or check_lengths(model)
    segments = (0, *itertools.accumulate(lengths))
    ids = (torch.arange(segments[-1], device=device) * 7 + 3) % model.config.get_text_config().vocab_size
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    was_training = model.training
    model.eval()
    try:
        alone = torch.cat(
            [
                decoder(input_ids=ids[None, s:e], use_cache=False).last_hidden_state[0]
                for s, e in itertools.pairwise(segments)
            ]
        )
        model.set_attn_implementation(PACKED_ATTENTION[inner])
        packed = decoder(
            input_ids=ids[None], position_ids=positions[None], packed_segments=segments, use_cache=False
        ).last_hidden_state[0]
        error = float((packed.float() - alone.float()).abs().max())
    except TypeError as failure:  # a layer that takes no packing arguments
        model.set_attn_implementation(own)
        message = f"{name} cannot run packed rows ({failure}); set data.packing: false"
        raise UnsupportedModelError(message) from failure
    finally:
        model.train(was_training)
    tolerance = 1e-4 if packed.dtype == torch.float32 else 3e-2
    if not error <= tolerance * max(1.0, float(alone.abs().max())):
        model.set_attn_implementation(own)
        raise UnsupportedModelError(
            f"{name}: a packed row's hidden states differ from its samples run alone (max difference "
            f"{error:.3g}): its layers mix tokens across samples other than through attention; set "
            "data.packing: false"
        )
