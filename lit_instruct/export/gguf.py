"""A merged model -> one GGUF file for llama.cpp, Ollama and LM Studio, with ``gguf``'s writer (no
llama.cpp checkout or build).

Written: the architecture's metadata, every tensor under GGUF's name in the layout llama.cpp expects
(Llama-style q/k rows permuted from Hugging Face's rotary layout back to the interleaved one; a tied
output head left out), the BPE tokenizer (tokens, types, merges, special ids, the pre-tokenizer name)
and the chat template. Norms and biases stay F32; matrices are stored as ``f32``, ``f16``, ``bf16``,
``q8_0`` or ``q4_0``. Only the families listed in :data:`SUPPORTED` are written; any other is refused
with its name, never written wrong. The file appears atomically (written beside it, then renamed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_instruct.export.gguf_vocab import is_sentencepiece, sentencepiece_file, write_vocabulary


@dataclass(frozen=True)
class Family:
    """How a ``transformers`` model type is written: as llama.cpp's ``convert_hf_to_gguf.py`` writes it
    (``tests/test_gguf_reference.py`` compares the two files key by key and byte by byte)."""

    arch: str
    """``gguf.MODEL_ARCH`` member name."""
    permute_qk: bool = False
    """Llama-style rotary: q/k rows go back to the interleaved layout."""
    llama_keys: bool = False
    """The converter's Llama path: it writes ``vocab_size``, ``rope.dimension_count`` and
    ``add_bos_token`` (others write the last only when the tokenizer's config sets it)."""
    metadata: Callable[[Any, Any], None] | None = None
    """Writes the family's own keys: ``metadata(writer, config)``."""
    rope_base: bool = True
    """The converter writes ``rope.freq_base`` (Gemma 2's does not: llama.cpp then takes 10000)."""
    norm_offset: float = 0.0
    """Added to every norm weight (Gemma's norms scale by ``1 + weight``; llama.cpp's by the weight)."""
    plain_added_tokens: bool = False
    """SentencePiece vocabularies: added tokens typed as the tokenizer marks them (Phi-3's converter)."""
    check: Callable[[Any], None] | None = None
    """Refuses a config llama.cpp would run differently from ``transformers``: ``check(config)``."""


def _phi3_metadata(writer: Any, config: Any) -> None:
    """Phi-3's rotary share, original context (its rope scaling's reference) and sliding window
    (0: none; llama.cpp tells Phi-4 from Phi-3 by it)."""
    rope = _rope(config)
    original = rope.get("original_max_position_embeddings", config.original_max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    rotary = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
    writer.add_rope_dimension_count(rotary)
    writer.add_sliding_window(config.sliding_window or 0)


def _gemma_metadata(writer: Any, config: Any) -> None:
    """Gemma 2/3: soft-capping (Gemma 2 always writes both; Gemma 3 the final one when set), the
    sliding window, and Gemma 3's rotary base for its sliding layers."""
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        swa_theta = _rope_parameters(config).get("sliding_attention", {}).get("rope_theta")
        if swa_theta is not None:
            writer.add_rope_freq_base_swa(swa_theta)
    writer.add_sliding_window(config.sliding_window)


def _check_gemma(config: Any) -> None:
    """What llama.cpp fixes for Gemma 2/3 instead of reading it from the file: every 2nd (Gemma 2) or
    6th (Gemma 3) layer global, the rest sliding; queries scaled by ``1/sqrt(head_dim)``
    (``hidden/heads`` for the 27B sizes, which it knows by their layer count); Gemma 2's rotary base
    10000; no attention soft-capping on Gemma 3."""
    gemma2 = config.model_type == "gemma2"
    every = 2 if gemma2 else 6
    layers = config.num_hidden_layers
    pattern = ["full_attention" if i % every == every - 1 else "sliding_attention" for i in range(layers)]
    if list(getattr(config, "layer_types", None) or pattern) != pattern:
        raise ValueError(
            f"GGUF export: llama.cpp runs {config.model_type} with every {every}th layer global and the rest "
            f"sliding, but config.layer_types is {config.layer_types}"
        )
    heads, _, head_dim = head_counts(config)
    scale_dim = config.hidden_size // heads if layers == (46 if gemma2 else 62) else head_dim
    if config.query_pre_attn_scalar != scale_dim:
        raise ValueError(
            f"GGUF export: llama.cpp scales {config.model_type} queries by 1/sqrt({scale_dim}), but "
            f"config.query_pre_attn_scalar is {config.query_pre_attn_scalar}"
        )
    if gemma2 and float(_rope(config).get("rope_theta", 10000.0)) != 10000.0:
        raise ValueError("GGUF export: llama.cpp runs Gemma 2 with rope_theta 10000 (the file holds none)")
    if not gemma2 and getattr(config, "attn_logit_softcapping", None):
        raise ValueError("GGUF export: llama.cpp's Gemma 3 has no attn_logit_softcapping")


LLAMA = Family("LLAMA", permute_qk=True, llama_keys=True)
GEMMA = {"metadata": _gemma_metadata, "norm_offset": 1.0, "check": _check_gemma}
SUPPORTED = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "phi3": Family("PHI3", metadata=_phi3_metadata, plain_added_tokens=True),
    "gemma2": Family("GEMMA2", rope_base=False, **GEMMA),  # type: ignore[arg-type]
    "gemma3_text": Family("GEMMA3", **GEMMA),  # type: ignore[arg-type]
}
QUANT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's half-split rotary rows -> the interleaved order llama.cpp uses, per head."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def head_counts(config: Any) -> tuple[int, int, int]:
    """Attention heads, key/value heads and the head dimension (the config's ``head_dim`` when set)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, config.num_key_value_heads or heads, head_dim


def llama_cpp_rows(tensor: torch.Tensor, layer: str, family: Family, config: Any) -> torch.Tensor:
    """The output rows of the projection ``layer`` (a module name) in llama.cpp's layout: q/k rows
    interleaved back for Llama-style rotary families, any other as it is. Applies to a weight and to
    a LoRA B matrix alike (both have the layer's output rows)."""
    if not family.permute_qk or not layer.endswith(("q_proj", "k_proj")):
        return tensor
    heads, kv_heads, _ = head_counts(config)
    return permute_rotary(tensor, heads if layer.endswith("q_proj") else kv_heads)


def check_supported(config: Any) -> Family:
    """The GGUF family of a ``transformers`` config, or a refusal naming what is supported."""
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"GGUF export of a vision-language model ({config.model_type}) is not written: llama.cpp reads "
            "its vision tower and projector from a separate mmproj file, which lit-instruct does not write "
            "yet; export --merge gives a model transformers loads (docs/images.md)"
        )
    family = SUPPORTED.get(config.model_type)
    if family is None:
        raise ValueError(
            f"GGUF export supports {sorted(SUPPORTED)}, not {config.model_type!r}: its tensor layout "
            "and metadata would have to be checked against llama.cpp first"
        )
    kind = _rope(config).get("rope_type", "default")
    if (
        kind != "default"
        and not (kind == "llama3" and family.llama_keys)
        and not (kind == "linear" and family.arch == "GEMMA3")
    ):
        raise ValueError(f"GGUF export does not write rope scaling {kind!r} yet (config.rope_scaling)")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            "GGUF export does not write sliding-window attention yet (config.use_sliding_window)"
        )
    if family.check is not None:
        family.check(config)
    return family


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope parameters (``rope_parameters`` in transformers 5, ``rope_scaling`` before)."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _rope(config: Any) -> dict[str, Any]:
    """The rope parameters of the global layers (Gemma 3 keeps one set per attention kind)."""
    parameters = _rope_parameters(config)
    return dict(parameters.get("full_attention", parameters))


def rope_factors(config: Any) -> torch.Tensor:
    """Llama 3's per-frequency rope scaling as llama.cpp stores it (``rope_freqs.weight``: what each
    inverse frequency is divided by): 1 for wavelengths under the original context over
    ``high_freq_factor``, ``factor`` past it over ``low_freq_factor``, smoothly in between; in double
    precision from the float32 frequencies, as llama.cpp's converter computes it (the test checks
    it against ``transformers``' own scaled frequencies too)."""
    rope = _rope(config)
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    dim = head_counts(config)[2]
    theta = float(rope.get("rope_theta", 10000.0))
    frequencies = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for frequency in frequencies.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def tensor_data(tensor: torch.Tensor, quant: str, output: bool = False) -> tuple[np.ndarray, Any]:
    """The bytes to store and their GGML type: 1-D tensors F32, matrices in ``quant`` (a row length
    that is not a multiple of the 32-value block falls back to F16). Under ``q4_0`` the output head
    (``output``: or the token embedding it is tied to) is stored as ``q8_0``, as llama.cpp's
    quantizer does for rows that are not a multiple of 256 (for the others it picks Q6_K, which
    ``gguf`` cannot write: Q8_0, more precise, stands in)."""
    import gguf

    data = tensor.detach().to(torch.float32).cpu().numpy()
    types = gguf.GGMLQuantizationType
    if data.ndim == 1 or quant == "f32":
        return data, types.F32
    if quant == "q4_0" and output:
        quant = "q8_0"
    if quant == "f16" or (quant in ("q8_0", "q4_0") and data.shape[-1] % 32):
        return data.astype(np.float16), types.F16
    qtype = {"bf16": types.BF16, "q8_0": types.Q8_0, "q4_0": types.Q4_0}[quant]
    return gguf.quants.quantize(data, qtype), qtype


def _write_metadata(writer: Any, model: Any, family: Family, quant: str, name: str) -> None:
    """The model's metadata: the keys llama.cpp's converter writes for the family."""
    import gguf

    config = model.config
    heads, kv_heads, head_dim = head_counts(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(_parameter_count(model), 0, 0, 0))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if family.llama_keys:
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:  # as llama.cpp's converter: whenever set
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = _rope(config)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if family.rope_base:
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        writer.add_rope_freq_base(float(theta))
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type.get(quant, "MOSTLY_Q4_0")))
    if family.metadata is not None:
        family.metadata(writer, config)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tensors(writer: Any, model: Any, family: Family, quant: str) -> None:
    """Every tensor under its GGUF name, in llama.cpp's layout and the storage type of ``quant``."""
    import gguf

    config = model.config
    tied = _tied(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.arch], config.num_hidden_layers)
    if _rope(config).get("rope_type") == "llama3":
        rope_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        writer.add_tensor(rope_name, rope_factors(config).numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses the token embedding
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r} of {config.model_type}")
        if hf_name.endswith(".weight"):
            tensor = llama_cpp_rows(tensor, hf_name.removesuffix(".weight"), family, config)
        if family.norm_offset and hf_name.endswith("norm.weight"):
            tensor = tensor.float() + family.norm_offset
        output = gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight")
        data, qtype = tensor_data(tensor, quant, output)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _parameter_count(model: Any) -> int:
    """The parameters the file holds (a tied output head once), as ``general.size_label`` counts them."""
    tied = _tied(model.config)
    return sum(p.numel() for name, p in model.state_dict().items() if not (tied and name == "lm_head.weight"))


def write_gguf(
    model: Any,
    tokenizer: Any,
    out: str | Path,
    quant: str = "f16",
    chat_template: str | None = None,
    tokenizer_pre: str | None = None,
    name: str | None = None,
    sentencepiece: Path | None = None,
) -> Path:
    """Write ``model`` (a merged ``transformers`` causal LM) and ``tokenizer`` to the GGUF file ``out``
    (``sentencepiece``: the ``tokenizer.model`` of a SentencePiece vocabulary, found beside the
    tokenizer when left out).

    Raises:
        ValueError: for an unsupported family, rope scaling, sliding windows, tokenizer or ``quant``.
    """
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant must be one of {QUANT_TYPES}, got {quant!r}")
    config = model.config
    family = check_supported(config)
    if sentencepiece is None and is_sentencepiece(tokenizer):
        sentencepiece = sentencepiece_file(tokenizer)  # refused before any writing when missing
    with gguf_file(out, family) as writer:
        _write_metadata(writer, model, family, quant, name or Path(out).stem)
        write_vocabulary(
            writer,
            tokenizer,
            config,
            pre=tokenizer_pre,
            chat_template=chat_template,
            add_bos=family.llama_keys,
            plain_added=family.plain_added_tokens,
            sentencepiece=sentencepiece,
        )
        _write_tensors(writer, model, family, quant)
    return Path(out)


@contextmanager
def gguf_file(out: str | Path, family: Family) -> Iterator[Any]:
    """A ``gguf.GGUFWriter`` for ``family`` whose file appears at ``out`` whole (written beside it,
    then renamed into place) once the block has added its metadata and tensors, or not at all."""
    import gguf

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(str(staging), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.arch]])
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, out)
    except BaseException:
        writer.close()
        staging.unlink(missing_ok=True)
        raise


def export_gguf(
    adapter: str | Path,
    out: str | Path,
    quant: str = "f16",
    base: str | None = None,
    tokenizer_pre: str | None = None,
    ollama: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Merge ``adapter`` into its full-precision base and write the GGUF file ``out`` with the chat
    template it was trained with (``chat_template`` overrides it: Jinja or a built-in name); with
    ``ollama`` also ``<out stem>.Modelfile`` beside it (:func:`lit_instruct.export.ollama.write_modelfile`).
    ``general.name`` is the base's name and the adapter's (its run folder's when it is named ``adapter``)."""
    from lit_instruct.adapter_folder import adapter_base, adapter_chat_template
    from lit_instruct.export.adapter import merged_model
    from lit_instruct.export.ollama import ollama_format, write_modelfile
    from lit_instruct.model_names import resolve_model_path
    from lit_instruct.templates import resolve_chat_template

    model, tokenizer = merged_model(adapter, base)
    check_supported(model.config)  # refusals before any writing
    base_name = adapter_base(adapter, base)
    folders = (resolve_model_path(base_name),)
    sentencepiece = sentencepiece_file(tokenizer, folders) if is_sentencepiece(tokenizer) else None
    template = resolve_chat_template(tokenizer, adapter_chat_template(adapter, chat_template))
    if ollama:
        ollama_format(tokenizer, template)
    folder = Path(adapter).resolve()
    label = folder.parent.name if folder.name == "adapter" else folder.name
    name = f"{Path(base_name).name}-{label}"
    written = write_gguf(model, tokenizer, out, quant, template, tokenizer_pre, name, sentencepiece)
    if ollama:
        write_modelfile(written, tokenizer, template)
    return written
