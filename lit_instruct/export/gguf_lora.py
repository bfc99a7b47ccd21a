"""A LoRA adapter -> a GGUF LoRA file that llama.cpp applies on top of its base's GGUF (``--lora``):
a few MB per fine-tune instead of a whole model.

Written as llama.cpp's ``convert_lora_to_gguf.py`` writes it (``tests/test_gguf_reference.py``
compares the two): each adapted matrix's A and B under ``<GGUF name>.lora_a`` / ``.lora_b``, B's rows
in llama.cpp's layout (the q/k permutation of the base applies to them), ``adapter.lora.alpha``.
llama.cpp scales every adapter by ``alpha / r``, so rsLoRA's ``alpha / sqrt(r)`` is written as the
alpha that gives it; what a GGUF LoRA cannot express (DoRA, per-layer ranks or alphas, adapted
embeddings or expert weights, extra trained modules) is refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lit_instruct.adapter_folder import adapter_base, read_config, read_weights
from lit_instruct.export.gguf import Family, check_supported, gguf_file, llama_cpp_rows, tensor_data

PREFIX = "base_model.model."
UNSUPPORTED = {
    "use_dora": "DoRA (its magnitude vector has no GGUF LoRA form)",
    "rank_pattern": "per-layer ranks (rank_pattern)",
    "alpha_pattern": "per-layer alphas (alpha_pattern: llama.cpp has one alpha per file)",
    "target_parameters": "adapted expert weights (target_parameters)",
    "modules_to_save": "fully trained modules (modules_to_save: export a merged GGUF instead)",
    "trainable_token_indices": "trained token rows (export a merged GGUF instead)",
}


def lora_alpha(config: dict[str, Any]) -> float:
    """The alpha llama.cpp needs for the adapter's scale (it always scales by ``alpha / r``)."""
    alpha, rank = float(config["lora_alpha"]), int(config["r"])
    return alpha * math.sqrt(rank) if config.get("use_rslora") else alpha


def check_exportable(config: dict[str, Any], adapter: Path) -> None:
    """Refuse an adapter whose computation a GGUF LoRA file cannot express."""
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{adapter}: a GGUF LoRA file cannot hold {what}; export a merged GGUF (--gguf)")


def write_lora_gguf(
    adapter: str | Path, out: str | Path, quant: str = "f32", base: str | None = None
) -> Path:
    """Write ``adapter`` (a PEFT LoRA folder) as the GGUF LoRA file ``out`` for its base's GGUF.

    Raises:
        ValueError: for an unsupported family, adapter variant or ``quant``; NaN/Inf weights.
    """
    import gguf
    from transformers import AutoConfig

    from lit_instruct.model_names import resolve_model_path

    if quant not in ("f32", "f16", "bf16", "q8_0"):
        raise ValueError(f"a GGUF LoRA file is f32, f16, bf16 or q8_0, not {quant!r}")
    adapter, out = Path(adapter), Path(out)
    settings = read_config(adapter)
    check_exportable(settings, adapter)
    config = AutoConfig.from_pretrained(resolve_model_path(adapter_base(adapter, base)))
    family = check_supported(config)
    weights = read_weights(adapter)
    with gguf_file(out, family) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_name(adapter.resolve().name)
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora_alpha(settings))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, data, qtype in _lora_tensors(weights, config, family, quant):
            writer.add_tensor(name, data, raw_dtype=qtype)
    return out


def _lora_tensors(
    weights: dict[str, Any], config: Any, family: Family, quant: str
) -> list[tuple[str, Any, Any]]:
    """``(GGUF name, data, type)`` of every A and B matrix."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.arch], config.num_hidden_layers)
    tensors = []
    for key, tensor in weights.items():
        stem, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(
                f"adapter tensor {key!r} is not a LoRA A or B matrix: not exportable as a GGUF LoRA"
            )
        gguf_name = names.get_name(f"{stem}.weight", try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for the adapted layer {stem!r} of {config.model_type}")
        if kind == "B.weight":  # B holds the layer's output rows; A its input columns
            tensor = llama_cpp_rows(tensor, stem, family, config)
        data, qtype = tensor_data(tensor, quant)
        tensors.append((f"{gguf_name}.lora_{kind[0].lower()}", data, qtype))
    return tensors
