"""LoRA adapters attached with peft, on the layers :mod:`lit_instruct.models.lora_targets` decides."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_instruct.adapter_folder import adapter_tensors, read_config, read_weights
from lit_instruct.errors import ConfigError
from lit_instruct.models.lora_targets import (
    LoRAConfigError,
    VisionLoRA,
    check_coverage,
    check_lora_names,
    check_targeted,
    lora_targets,
)
from lit_instruct.models.residual_init import is_residual_init

__all__ = ["LoRAConfig", "LoRAConfigError", "attach_lora", "check_lora_names", "load_lora"]


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
    use_dora: bool = False
    """DoRA: a trained magnitude per output row on top of the low-rank direction (peft's ``use_dora``;
    its layers run peft's own forward, not the fused LoRA layers)."""
    init: str = "default"
    """Adapter initialisation: ``default`` (peft's: A Kaiming-uniform, B zero), ``gaussian`` (A normal
    with std 1/r), ``pissa`` / ``pissa_niter_N`` (the weight's top singular vectors, exact or by N
    randomized-SVD iterations) or ``olora`` (its QR decomposition): these two train on the residual
    base and save plain LoRA of rank 2r on the original one (:mod:`lit_instruct.models.residual_init`).
    ``eva``: A from the training data's layer inputs, ranks redistributed (peft's EVA, run when the
    fit starts: :mod:`lit_instruct.models.eva_init`); ``loftq`` (NF4 bases: the quantization error's
    best rank-r fit). CorDA is refused."""
    layers_to_transform: list[int] | None = None
    """Only these decoder layers (by index) get adapters: their linear layers, expert weights and
    layers adapted through their weight, and no other (each index must be a layer of the model)."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Ranks other than ``r`` for the modules whose names match these keys (peft's regex keys)."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Alphas other than ``alpha`` for the modules whose names match these keys."""
    loraplus_lr_ratio: float | None = None
    """LoRA+: the B matrices (and 1-D adapter weights such as DoRA's magnitudes) learn at this many
    times the learning rate, as peft's ``create_loraplus_optimizer`` groups them."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained whole and saved with the adapter (peft's ``modules_to_save``), e.g.
    ``[embed_tokens, lm_head]`` to train the whole embedding and head of a model given new tokens
    (by default only the new tokens' rows train)."""
    allow_partial: bool = False
    """Train even when peft could not put an adapter on every module asked for (they are named in
    the coverage line); otherwise that is an error at build."""
    vision: VisionLoRA = "none"
    """A vision-language model's linear layers outside its language model: ``none`` (frozen),
    ``projector`` (adapters on the projector that maps image features into the decoder: LLaVA's
    ``multi_modal_projector``, Idefics3's ``connector``, Qwen-VL's ``merger``) or ``all`` (the
    vision tower's too). Needs ``target_modules: [all-linear]``."""


def refuse_by_weight(lora: LoRAConfig, by_weight: list[str], residual: bool) -> None:
    """Refuse the settings peft cannot honour on layers adapted through their weight (expert weights,
    or dense layers peft would rename into them)."""
    where = (
        f"model.lora.target_modules {lora.target_modules} here: {by_weight[0]} (and {len(by_weight) - 1} "
        "more) is adapted through its weight (expert weights, or layers peft would rename into them)"
    )
    dense = "name the dense layers in model.lora.target_modules (e.g. [q_proj, k_proj, v_proj, o_proj])"
    if lora.use_dora:
        raise ConfigError(
            "model.lora.use_dora",
            f"true cannot be combined with {where}, which peft's DoRA cannot do: {dense}",
        )
    if residual or lora.init == "eva":
        raise ConfigError(
            "model.lora.init",
            f"{lora.init!r} cannot be combined with {where}, which it cannot initialise: {dense}",
        )
    if lora.dropout:
        raise ConfigError(
            "model.lora.dropout",
            f"{lora.dropout} cannot be combined with {where}, where peft has no dropout: set "
            f"model.lora.dropout: 0, or {dense}",
        )


def attach_lora(
    model: nn.Module,
    lora: LoRAConfig,
    probe: bool = True,
    trainable_tokens: dict[str, list[int]] | None = None,
    initialise: bool = True,
) -> Any:
    """Wrap ``model`` in a peft LoRA model; every non-adapter parameter is frozen but the rows of
    ``trainable_tokens`` (module name -> token ids: peft's ``trainable_token_indices``; a module in
    ``lora.modules_to_save`` trains whole instead).

    ``target_modules: [all-linear]`` adapts every linear layer but the output head and every 3-D
    expert weight (peft's ``target_parameters``). What peft adapted is then checked against what was
    asked (:mod:`lit_instruct.models.lora_targets`): a shortfall raises unless ``lora.allow_partial``, an
    adapter nobody asked for always; the result is the returned model's ``lora_coverage``. ``probe``: see
    :func:`lora_targets`. ``initialise: false`` (a weightless skeleton): every check, peft's default
    init instead of ``lora.init`` (the adapters' structure is the same).

    Raises:
        LoRAConfigError: a LoRA setting names nothing in ``model`` (:func:`check_lora_names`), or a
            targeted linear layer is not a plain linear map.
        LoRACoverageError: peft's adapters are not exactly the targets.
    """
    from peft import EvaConfig, LoraConfig, get_peft_model

    residual = is_residual_init(lora.init)
    if residual and lora.use_rslora and (lora.rank_pattern or lora.alpha_pattern):
        raise ConfigError(
            "model.lora.init",
            f"{lora.init!r} cannot be combined with model.lora.use_rslora: true and rank or alpha patterns: "
            "its adapter could not be saved as plain LoRA on the original base (nor can peft convert it)",
        )
    check_lora_names(model, lora)
    targets = lora_targets(model, lora.target_modules, probe, lora.layers_to_transform, lora.vision)
    check_targeted(targets, lora)  # again after the probe forward, which may leave layers out
    by_weight = targets.parameters + targets.by_weight
    if by_weight:
        refuse_by_weight(lora, by_weight, residual)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int, takes any number
        lora_dropout=lora.dropout,
        target_modules=targets.peft_modules,
        target_parameters=targets.peft_parameters or None,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        init_lora_weights=True if lora.init in ("default", "loftq") or not initialise else lora.init,  # type: ignore[arg-type]
        eva_config=EvaConfig() if lora.init == "eva" and initialise else None,
        layers_to_transform=lora.layers_to_transform,
        rank_pattern=lora.rank_pattern,
        alpha_pattern=lora.alpha_pattern,
        modules_to_save=lora.modules_to_save or None,
        trainable_token_indices={
            name: ids for name, ids in (trainable_tokens or {}).items() if name not in lora.modules_to_save
        }
        or None,
        task_type="CAUSAL_LM",
        bias="none",
    )
    peft_model: Any = get_peft_model(model, config)
    peft_model.lora_coverage = check_coverage(peft_model, targets, lora.allow_partial)
    return peft_model


def load_lora(model: nn.Module, adapter: str | Path) -> Any:
    """Wrap ``model`` in the PEFT adapter saved in ``adapter`` (ours or anyone's), trainable, as the
    starting point of further training: its own settings (rank, alpha, targets, variant), every one of
    its tensors loaded into a layer of the same shape.

    Raises:
        ValueError: when a saved tensor has no place in ``model`` (another base) or is not finite.
    """
    from peft import PeftModel

    folder = Path(adapter)
    saved = read_weights(folder)
    try:
        peft_model: Any = PeftModel.from_pretrained(model, folder, is_trainable=True)
    except (RuntimeError, ValueError) as failure:  # size mismatch, target modules not found
        raise ConfigError("model.adapter", f"{folder} does not fit this base model: {failure}") from failure
    loaded = adapter_tensors(peft_model)
    unplaced = sorted(set(saved) ^ set(loaded))
    if unplaced:
        raise ConfigError(
            "model.adapter",
            f"{folder}: {len(unplaced)} adapter tensors are not both saved and placed in this "
            f"base model (e.g. {unplaced[0]}): an adapter of another base?",
        )
    for key, tensor in saved.items():
        if loaded[key].is_meta:  # a low_memory_load rank: its shards come from rank 0's (checked) weights
            continue
        if not torch.equal(loaded[key].cpu().to(tensor.dtype), tensor):
            raise ConfigError("model.adapter", f"{folder}: {key} did not load as saved")
    return peft_model


def lora_config_of(adapter: str | Path) -> LoRAConfig:
    """The :class:`LoRAConfig` an adapter folder was saved with (what checkpoints record)."""
    saved = read_config(adapter)
    targets = saved.get("target_modules") or []
    return LoRAConfig(
        r=saved["r"],
        alpha=saved["lora_alpha"],
        dropout=saved.get("lora_dropout", 0.0),
        target_modules=sorted(targets) if isinstance(targets, list | set) else [targets],
        use_rslora=saved.get("use_rslora", False),
        use_dora=saved.get("use_dora", False),
        layers_to_transform=saved.get("layers_to_transform"),
        rank_pattern=saved.get("rank_pattern") or {},
        alpha_pattern=saved.get("alpha_pattern") or {},
        modules_to_save=sorted(saved.get("modules_to_save") or []),
    )


STRUCTURE: tuple[str, ...] = ("r", "alpha", "dropout", "target_modules", "use_rslora", "use_dora")
STRUCTURE += ("layers_to_transform", "rank_pattern", "alpha_pattern", "modules_to_save")
"""The :class:`LoRAConfig` fields an adapter folder fixes."""


def same_structure(name: str, one: LoRAConfig, other: LoRAConfig) -> bool:
    """Whether ``one`` and ``other`` agree on the structural field ``name`` (of :data:`STRUCTURE`;
    module lists in any order)."""
    mine, theirs = getattr(one, name), getattr(other, name)
    return set(mine) == set(theirs) if name in ("target_modules", "modules_to_save") else mine == theirs


def with_adapter_structure(asked: LoRAConfig, saved: LoRAConfig) -> LoRAConfig:
    """``asked`` with the structure of the adapter it continues (``saved``); a structural field set
    to something else than its default and the adapter's is an error."""
    default = LoRAConfig()
    for name in STRUCTURE:
        mine, theirs = getattr(asked, name), getattr(saved, name)
        if mine != getattr(default, name) and not same_structure(name, asked, saved):
            raise ConfigError(
                f"model.lora.{name}",
                f"{mine!r} cannot be combined with model.adapter, trained with {theirs!r}: the adapter "
                f"fixes the LoRA structure; leave model.lora.{name} unset",
            )
    return replace(asked, **{name: getattr(saved, name) for name in STRUCTURE})
