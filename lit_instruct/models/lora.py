"""LoRA adapters attached with peft, on the layers :mod:`lit_instruct.models.lora_targets` decides."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_instruct.models.lora_targets import check_coverage, lora_targets


@dataclass
class LoRAConfig:
    """LoRA adapter settings (peft)."""

    r: int = 16
    """Rank of the low-rank update."""
    alpha: float = 32.0
    """Scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names of the linear layers that get adapters; ``["all-linear"]`` (the default) is every linear
    layer of the decoder but the output head (fused ``qkv_proj`` / ``gate_up_proj`` and GPT-2's
    ``Conv1D`` included; routers and Mamba ``out_proj`` left out, by name), plus the 3-D expert
    weights of MoE layers."""
    use_rslora: bool = False
    """Rank-stabilized LoRA scaling (alpha / sqrt(r))."""
    allow_partial: bool = False
    """Train even when peft could not put an adapter on every module asked for (they are named in
    the coverage line); otherwise that is an error at build."""


def attach_lora(model: nn.Module, lora: LoRAConfig, probe: bool = True) -> Any:
    """Wrap ``model`` in a peft LoRA model; every non-adapter parameter is frozen.

    ``target_modules: [all-linear]`` adapts every linear layer but the output head and every 3-D
    expert weight (peft's ``target_parameters``). What peft adapted is then checked against what was
    asked (:mod:`lit_instruct.models.lora_targets`): a shortfall raises unless ``lora.allow_partial``; the
    result is the returned model's ``lora_coverage``. ``probe``: see :func:`lora_targets`.
    """
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, lora.target_modules, probe)
    by_weight = targets.parameters + targets.by_weight
    if by_weight and lora.dropout:
        raise ValueError(
            f"model.lora.dropout is {lora.dropout}, but {by_weight[0]} (and {len(by_weight) - 1} more) is "
            "adapted through its weight (expert weights, or layers peft would rename into them), where peft "
            "has no dropout: set model.lora.dropout: 0, or name other target_modules"
        )
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int, takes any number
        lora_dropout=lora.dropout,
        target_modules=targets.peft_modules,
        target_parameters=targets.peft_parameters or None,
        use_rslora=lora.use_rslora,
        task_type="CAUSAL_LM",
        bias="none",
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model: Any = get_peft_model(model, config)
    peft_model.lora_coverage = check_coverage(peft_model, targets, lora.allow_partial)
    return peft_model
