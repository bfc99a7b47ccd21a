"""Resolve a model name to weights, load the base model, and attach LoRA adapters with peft."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lit_instruct.models import BUNDLED_MODELS

DType = Literal["float32", "bfloat16", "float16"]

ALL_LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_model_path(name: str) -> str:
    """Return a local folder or hub id for ``name``.

    A bundled name (``smollm2-135m-instruct``) is prepared into the cache on first use; an existing
    local path is used as is; anything else is passed to ``transformers`` as a hub id.
    """
    if name in BUNDLED_MODELS:
        return str(BUNDLED_MODELS[name]())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json: not a transformers model")
        return str(path)
    return name


@dataclass
class LoRAConfig:
    """LoRA adapter settings (peft)."""

    r: int = 16
    """Rank of the low-rank update."""
    alpha: float = 32.0
    """Scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LLAMA_LINEAR))
    """Names of the linear layers that get adapters ("all-linear" is accepted as a single entry)."""
    use_rslora: bool = False
    """Rank-stabilized LoRA scaling (alpha / sqrt(r))."""


def load_base_model(name: str, dtype: DType = "float32", trust_remote_code: bool = False) -> nn.Module:
    """Load a causal LM from a bundled name, a local folder or a hub id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(name),
        dtype=getattr(torch, dtype),
        trust_remote_code=trust_remote_code,
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    return model


def attach_lora(model: nn.Module, lora: LoRAConfig) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model; every non-adapter parameter is frozen."""
    from peft import LoraConfig, get_peft_model

    targets: list[str] | str = lora.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, config)
