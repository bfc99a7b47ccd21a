"""Load a base model from a bundled name, a local folder or a hub id: full precision, 4-bit (QLoRA),
or its skeleton on the meta device."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lit_instruct.model_names import resolve_model_path
from lit_instruct.models.decoder import parts_outside_decoder
from lit_instruct.models.four_bit import check_training_layout, keep_training_layout, require_bitsandbytes
from lit_instruct.models.gemm_attention import use_gemm_attention

DType = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["none", "nf4", "fp4"]

AttnImplementation = Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"]


@dataclass
class QuantizationConfig:
    """4-bit base weights (QLoRA) through bitsandbytes."""

    method: Quantization = "none"
    """``nf4`` or ``fp4`` for 4-bit linear layers, ``none`` for full-precision weights."""
    double_quant: bool = True
    """Quantize the quantization constants too (about 0.4 bit per weight saved)."""
    compute_dtype: DType = "bfloat16"
    """Dtype of the 4-bit layers' matmuls and of every weight left unquantized (embeddings, norms)."""


def quantization_device(environ: Mapping[str, str] = os.environ, cuda_devices: int | None = None) -> str:
    """Where a 4-bit base is quantized: this process's own GPU, ``cuda:<LOCAL_RANK>`` (the rank's
    device under Lightning's DDP launcher and torchrun, which set ``LOCAL_RANK``, and under srun,
    which sets ``SLURM_LOCALID``; 0 otherwise),
    else the CPU. The module is built before the Trainer places it, so every rank quantizing onto
    ``cuda:0`` would put all ranks' bases on one GPU; afterwards Lightning moves the module to the
    Trainer's device (``accelerator: cpu`` included).
    """
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if count == 0:
        return "cpu"
    srun = int(environ.get("SLURM_NTASKS", "1")) > 1  # srun sets SLURM_LOCALID, not LOCAL_RANK
    local_rank = int(environ.get("LOCAL_RANK", environ.get("SLURM_LOCALID", "0") if srun else "0"))
    if local_rank >= count:
        raise ValueError(f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible")
    return f"cuda:{local_rank}"


def model_class(config: Any) -> Any:
    """The ``transformers`` auto class that builds ``config``: the image-text-to-text class of a
    vision-language model (its vision tower and projector kept), else the causal LM class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    vision = getattr(config, "vision_config", None) is not None
    if vision and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def vision_parts(config: Any, trust_remote_code: bool = False) -> list[str]:
    """The module names of a vision-language model's vision tower and projector (``[]`` for a text
    model), read from its skeleton on the meta device: what a 4-bit base keeps in its compute dtype."""
    if getattr(config, "vision_config", None) is None:
        return []
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    return parts_outside_decoder(skeleton)


def load_base_model(
    name: str,
    dtype: DType = "float32",
    trust_remote_code: bool = False,
    quantization: QuantizationConfig | None = None,
    attn_implementation: AttnImplementation = "auto",
    meta: bool = False,
) -> nn.Module:
    """Load a causal LM from a bundled name, a local folder or a hub id.

    With 4-bit ``quantization`` the linear layers of the decoder become frozen bitsandbytes
    ``Linear4bit`` layers and every other weight (embeddings, norms) is kept in ``compute_dtype``.
    With ``meta`` only its skeleton is built (no weights read, no memory), for a rank that receives
    its shards from rank 0 (:func:`lit_instruct.train.fsdp.fill_from_rank_zero`).
    """
    from transformers import AutoConfig

    if meta:
        if quantization is not None and quantization.method != "none":
            raise ValueError(
                "a 4-bit base cannot be built on the meta device (it is quantized from its weights)"
            )
        config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
        extra = {"attn_implementation": attn_implementation} if attn_implementation != "auto" else {}
        with torch.device("meta"):
            skeleton = model_class(config).from_config(
                config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, **extra
            )
        skeleton.config.use_cache = False
        if attn_implementation == "auto":
            use_gemm_attention(skeleton)
        return skeleton

    kwargs: dict = {}
    if quantization is not None and quantization.method != "none":
        from transformers import BitsAndBytesConfig

        require_bitsandbytes()
        dtype = quantization.compute_dtype
        skeleton_config = AutoConfig.from_pretrained(
            resolve_model_path(name), trust_remote_code=trust_remote_code
        )
        vision = vision_parts(skeleton_config, trust_remote_code)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            # a vision tower and projector stay in the compute dtype; a text model: transformers' own list
            llm_int8_skip_modules=["lm_head", *vision] if vision else None,
            bnb_4bit_quant_type=quantization.method,
            bnb_4bit_use_double_quant=quantization.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, dtype),
            bnb_4bit_quant_storage=getattr(torch, dtype),  # packed in the compute dtype: FSDP can shard it
        )
        kwargs["device_map"] = {"": quantization_device()}
    if attn_implementation != "auto":
        kwargs["attn_implementation"] = attn_implementation
    if trust_remote_code:
        warnings.warn(f"trust_remote_code=True: code shipped with {name} will run", stacklevel=2)
    config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    model = model_class(config).from_pretrained(
        resolve_model_path(name),
        dtype=getattr(torch, dtype),
        trust_remote_code=trust_remote_code,
        **kwargs,
    )
    model.config.use_cache = False
    if attn_implementation == "auto":  # an explicit sdpa keeps PyTorch's kernel
        use_gemm_attention(model)
    if "quantization_config" in kwargs:
        keep_training_layout(model)
        check_training_layout(model, getattr(torch, dtype))
    return model


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the base model: all of it, and its 4-bit linear layers (weights + quant state).

    LoRA adapter weights are not counted; tied weights count once.
    """
    total = quantized = 0
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if "lora_" in f"{module_name}.{name}" or id(p) in seen:
                continue
            seen.add(id(p))
            size = p.numel() * p.element_size()
            state = getattr(p, "quant_state", None)
            if state is not None:
                size += _quant_state_bytes(state)
                quantized += size
            total += size
        for b in module.buffers(recurse=False):
            total += b.numel() * b.element_size()
    return {"total": total, "quantized_linear": quantized}


def _quant_state_bytes(state: object) -> int:
    tensors = [getattr(state, "absmax", None), getattr(state, "code", None), getattr(state, "offset", None)]
    size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    nested = getattr(state, "state2", None)
    return size + (_quant_state_bytes(nested) if nested is not None else 0)
