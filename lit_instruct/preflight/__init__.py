"""Everything a config can be checked for before any weights are read: each value
(:mod:`lit_instruct.rules`), each pair of settings that cannot go together, where ``model.model``
points, and the LoRA structure (targets, layers, patterns, a continued adapter's fit) on the base's
skeleton built on the meta device from its ``config.json``. ``fit`` and ``validate`` run it first;
``lit-instruct check`` runs it with the data check and prints the plan.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from lit_instruct.errors import ConfigError, closest
from lit_instruct.io import check_replaceable
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.models.four_bit import require_bitsandbytes
from lit_instruct.models.load import QuantizationConfig, load_base_model
from lit_instruct.models.lora import LoRAConfig, attach_lora, lora_config_of, with_adapter_structure
from lit_instruct.models.packing import UNPACKABLE_MODEL_TYPES
from lit_instruct.objectives.choice import resolve_objective
from lit_instruct.preflight.adapter_fit import adapter_on_skeleton, check_adapter_folder
from lit_instruct.preflight.model_source import model_source
from lit_instruct.preflight.resume import check_resume_structure, run_folders
from lit_instruct.rules import check_values, flatten, refuse_conflicts

OBJECTIVE_CHECKED = ("packing", "neftune_noise_alpha", "loss")
"""The model settings an objective checks (:meth:`~lit_instruct.objectives.Objective.check`)."""
NOT_PROBED = "layers the model never calls: found when the weights load"


def config_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat settings (``model.lora.r``...) of a parsed ``fit`` config, defaults filled in for the
    nested LoRA and quantization settings."""
    model = dict(config.get("model") or {})
    model["lora"] = asdict(_settings(LoRAConfig, model.get("lora"), "model.lora"))
    model["quantization"] = asdict(
        _settings(QuantizationConfig, model.get("quantization"), "model.quantization")
    )
    if model.get("preference") is not None:
        model["preference"] = asdict(_settings(PreferenceConfig, model["preference"], "model.preference"))
    return flatten({**config, "model": model})


def _settings(kind: Any, values: Any, setting: str) -> Any:
    """``kind`` (a settings dataclass) from a config's mapping; a key it does not have is refused."""
    if values is None or isinstance(values, kind):
        return values or kind()
    known = [f.name for f in fields(kind)]
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ConfigError(
            f"{setting}.{unknown[0]}",
            f"is not a setting{closest(unknown[0], known)}; the settings are {', '.join(known)}",
        )
    return kind(**values)


@dataclass
class ModelPlan:
    """What the model check found: the base, what LoRA adapts, and the sizes that set memory."""

    source: str
    model_type: str
    parameters: int
    trainable: int
    coverage: str
    layers: int
    hidden: int
    intermediate: int
    quantized_linear: int
    """Parameters of the decoder's linear layers (4-bit under QLoRA)."""


def check_config(config: Mapping[str, Any]) -> ModelPlan:
    """Check a parsed ``fit`` config before anything is loaded; the model's plan when it passes.

    Raises:
        ConfigError: the first setting (or pair) that cannot work, naming it.
    """
    settings = config_settings(config)
    check_values(settings)
    objective = resolve_objective(settings.get("model.objective"), settings.get("model.preference"))
    refuse_conflicts(settings)
    objective.check(
        {name: settings[f"model.{name}"] for name in OBJECTIVE_CHECKED if f"model.{name}" in settings}
    )
    lora = LoRAConfig(**settings["model.lora"])
    adapter = settings.get("model.adapter")
    if adapter is not None:
        check_adapter_folder(adapter)
        lora = with_adapter_structure(lora, lora_config_of(adapter))
    if settings["model.quantization.method"] != "none":
        require_bitsandbytes()
    name = settings["model.model"]
    check_resume(config.get("ckpt_path"), name, lora, settings)
    source = model_source(name)
    skeleton = _skeleton(source, settings)
    model_type = str(getattr(skeleton.config, "model_type", "?"))
    if settings.get("model.packing") and model_type in UNPACKABLE_MODEL_TYPES:
        raise ConfigError(
            "data.packing",
            f"true cannot be combined with model.model {name!r}: a {model_type} model "
            f"{UNPACKABLE_MODEL_TYPES[model_type]}, so a packed row is not its samples run alone; "
            "set data.packing: false",
        )
    parameters = sum(p.numel() for p in skeleton.parameters())
    head = skeleton.get_output_embeddings()
    quantized = sum(
        m.weight.numel() for m in skeleton.modules() if isinstance(m, nn.Linear) and m is not head
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if adapter is not None:
            wrapped = adapter_on_skeleton(adapter, skeleton, name)
            coverage = f"LoRA: continues {adapter}"
        else:  # every check of the init too; the init itself needs the weights
            wrapped = _attach(skeleton, lora)
            found = wrapped.lora_coverage
            if settings["model.quantization.method"] != "none" and not lora.allow_partial:
                refuse_four_bit_by_weight(
                    settings["model.quantization.method"], lora, found.targets.by_weight
                )
            probed = replace(found, targets=replace(found.targets, probed=True))
            coverage = f"{probed.line()} ({NOT_PROBED})"
    text = getattr(skeleton.config, "text_config", None) or skeleton.config
    return ModelPlan(
        source=source,
        model_type=model_type,
        parameters=parameters,
        trainable=sum(p.numel() for p in wrapped.parameters() if p.requires_grad),
        coverage=coverage,
        layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        hidden=int(getattr(text, "hidden_size", 0) or 0),
        intermediate=int(getattr(text, "intermediate_size", 0) or 0),
        quantized_linear=quantized,
    )


SPECIAL_CHECKPOINTS = ("best", "hpc", "registry")
"""``ckpt_path`` values Lightning resolves itself (``last`` is resolved when the config is read)."""


def check_trains_something(trainer: Mapping[str, Any]) -> None:
    """A Trainer setting that leaves no optimizer step (``max_steps: 0``, ``max_epochs: 0``,
    ``limit_train_batches: 0``) is refused: a run that trains nothing is no success."""
    for setting in ("max_steps", "max_epochs", "limit_train_batches"):
        value = trainer.get(setting)
        if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
            raise ConfigError(
                f"trainer.{setting}",
                f"{value} trains nothing; give a positive number (max_steps -1 and max_epochs -1: no limit)",
            )


def check_adapter_dir(config: Mapping[str, Any]) -> None:
    """A fit's ``model.adapter_dir`` is written whole at the end: it must hold nothing but an adapter
    of ours, and none of the folders the run writes its checkpoints and logs into."""
    adapter_dir = (config.get("model") or {}).get("adapter_dir")
    if not adapter_dir:
        return
    target = Path(adapter_dir).resolve()
    for folder in run_folders(config):
        if target == folder.resolve() or target in folder.resolve().parents:
            raise ConfigError(
                "model.adapter_dir",
                f"{adapter_dir!r} holds the run's folder {str(folder)!r} (checkpoints, logs), which "
                "writing the adapter would delete; name a folder of its own, e.g. "
                f"{str(Path(adapter_dir) / 'adapter')!r}",
            )
    check_replaceable(target, "model.adapter_dir")


def check_resume(ckpt_path: Any, name: str, lora: LoRAConfig, settings: Mapping[str, Any]) -> None:
    """The checkpoint a fit resumes from: there, readable, and of the run's structure."""
    special = str(ckpt_path) in SPECIAL_CHECKPOINTS or str(ckpt_path).startswith("registry:")
    if ckpt_path is None or special or "://" in str(ckpt_path):  # Lightning resolves or fetches these
        return
    if not os.path.exists(ckpt_path):
        raise ConfigError("ckpt_path", f"{str(ckpt_path)!r} does not exist (a .ckpt file, or 'last')")
    preference = settings.get("model.preference")
    module = {
        "model": name,
        "lora": asdict(lora),
        "quantization": {"method": settings["model.quantization.method"]},
        "preference": preference,
        "objective": settings.get("model.objective"),
    }
    check_resume_structure(module, ckpt_path)


def refuse_four_bit_by_weight(method: str, lora: LoRAConfig, by_weight: list[str]) -> None:
    """Layers peft adapts through their weight (named like the experts it rewrites) cannot be so
    adapted once 4-bit: the build would find them after loading; refuse them from the skeleton."""
    if by_weight:
        raise ConfigError(
            "model.quantization.method",
            f"{method!r} cannot be combined with model.lora.target_modules {lora.target_modules}: "
            f"{by_weight[0]} (and {len(by_weight) - 1} more) is adapted through its weight, which a 4-bit "
            "layer cannot be: name other targets, or set model.lora.allow_partial: true",
        )


def _attach(skeleton: Any, lora: LoRAConfig) -> Any:
    """``attach_lora`` with every check on the skeleton; peft's own refusals (a target that is no
    layer it can adapt) as config errors."""
    try:
        return attach_lora(skeleton, lora, probe=False, initialise=False)
    except ConfigError:
        raise
    except ValueError as failure:
        first = str(failure).strip().splitlines()[0]
        raise ConfigError("model.lora.target_modules", f"{lora.target_modules}: {first}") from None


def _skeleton(source: str, settings: Mapping[str, Any]) -> Any:  # a transformers model: Any
    """The base built on the meta device from its config (no weights read)."""
    try:
        return load_base_model(
            source,
            settings.get("model.dtype", "float32"),
            bool(settings.get("model.trust_remote_code", False)),
            attn_implementation=settings.get("model.attn_implementation", "auto"),
            meta=True,
        )
    except (OSError, ValueError, ImportError, KeyError) as failure:
        first = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
        setting = "model.attn_implementation" if "attn" in first.lower() else "model.model"
        raise ConfigError(setting, f"{settings.get(setting)!r}: {first}") from None
