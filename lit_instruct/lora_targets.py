"""Where LoRA goes, and a check on the user's own model that peft put it there.

``target_modules: [all-linear]`` asks for every linear layer of the decoder (``nn.Linear`` and
transformers' ``Conv1D``; fused ``qkv_proj`` / ``gate_up_proj`` included) and every 3-D expert weight
of MoE layers, but the output head. Documented exclusions, named on the coverage line: linear
subclasses whose forward is not a plain linear layer (MoE routers that return routing tuples: a LoRA
layer around them fails), and the ``out_proj`` of Mamba mixers, which peft refuses for those model
types (their fused kernels read the weight). After peft has attached the adapters, what it adapted is
compared with what was asked: a shortfall is an error that names the modules, never a silently
partial adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

MAMBA_MODEL_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
"""Model types whose ``out_proj`` (and ``conv1d``, no linear layer) peft refuses to adapt (its list)."""
PEFT_MOE_RENAMED = frozenset({"gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3"})
"""Target names peft's transformers-v4 MoE conversion turns into the experts' fused weights."""


class LoRACoverageError(ValueError):
    """peft did not put an adapter on every module or expert weight that was asked for."""


@dataclass
class LoRATargets:
    """What must carry an adapter (full names, relative to the base model), what is left out and
    why, and the names handed to peft."""

    modules: list[str]
    parameters: list[str] = field(default_factory=list)
    left_out: dict[str, list[str]] = field(default_factory=dict)
    peft_modules: list[str] = field(default_factory=list)
    peft_parameters: list[str] = field(default_factory=list)


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (bitsandbytes' 4-bit layers included) or transformers' ``Conv1D`` (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def _plain(module: nn.Module) -> bool:
    """Its forward is a linear layer's: ``nn.Linear``'s or ``Conv1D``'s own, or a quantized linear's."""
    from transformers.pytorch_utils import Conv1D

    kind = type(module)
    return kind.forward in (nn.Linear.forward, Conv1D.forward) or kind.__module__.startswith("bitsandbytes")


def _matches(name: str, target: str) -> bool:
    """peft's rule for a listed target: the full name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def lora_targets(model: Any, target_modules: list[str]) -> LoRATargets:
    """The modules (and for ``all-linear`` the expert weights) that must get adapters."""
    names = [name for name, _ in model.named_modules() if name]
    if target_modules not in (["all-linear"], "all-linear"):
        asked = [name for name in names if any(_matches(name, t) for t in target_modules)]
        return LoRATargets(modules=asked, peft_modules=list(target_modules))
    head = model.get_output_embeddings()
    mamba = getattr(model.config, "model_type", None) in MAMBA_MODEL_TYPES
    targets = LoRATargets(modules=[])
    for name, module in model.named_modules():
        if not is_linear(module) or module is head:
            continue
        if mamba and name.rsplit(".", 1)[-1] == "out_proj":
            reason = "Mamba out_proj (peft refuses it: the fused Mamba kernels read its weight)"
        elif not _plain(module):
            reason = f"{type(module).__name__} (its forward is not a plain linear layer: a router)"
        else:
            targets.modules.append(name)
            continue
        targets.left_out.setdefault(reason, []).append(name)
    experts = {
        f"{module_name}.{name}": f"{module_name.rsplit('.', 1)[-1]}.{name}"
        for module_name, module in model.named_modules()
        for name, p in module.named_parameters(recurse=False)
        if p.dim() == 3 and not isinstance(module, nn.Conv1d)
    }
    targets.parameters = sorted(experts)
    targets.peft_parameters = sorted(set(experts.values()))
    targets.peft_modules = _peft_names(names, targets.modules)
    return targets


def _peft_names(names: list[str], asked: list[str]) -> list[str]:
    """The shortest peft targets that match exactly ``asked``: a leaf name where every module so
    named is asked for (``q_proj``), else the full names (``altup_projections.0``, a router's twin)."""
    wanted = set(asked)
    by_leaf: dict[str, list[str]] = {}
    for name in asked:
        by_leaf.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    out: list[str] = []
    for leaf, members in sorted(by_leaf.items()):
        exact = all(name in wanted for name in names if _matches(name, leaf))
        out += [leaf] if exact else members
    return out


@dataclass
class LoRACoverage:
    """What peft adapted against what was asked."""

    targets: LoRATargets
    missing_modules: list[str]
    missing_parameters: list[str]

    def line(self) -> str:
        """``LoRA: 14 of 14 linear layers, 4 of 4 expert weights (left out: ...)``."""
        t = self.targets
        text = f"LoRA: {len(t.modules) - len(self.missing_modules)} of {len(t.modules)} linear layers"
        if t.parameters:
            adapted = len(t.parameters) - len(self.missing_parameters)
            text += f", {adapted} of {len(t.parameters)} expert weights"
        left = [f"{reason} x{len(names)}" for reason, names in t.left_out.items()]
        return text + (f" (left out: {'; '.join(left)})" if left else "")

    def hparams(self) -> dict[str, float]:
        t = self.targets
        return {
            "model/lora_linear_asked": float(len(t.modules)),
            "model/lora_linear_adapted": float(len(t.modules) - len(self.missing_modules)),
            "model/lora_expert_weights_asked": float(len(t.parameters)),
            "model/lora_expert_weights_adapted": float(len(t.parameters) - len(self.missing_parameters)),
            "model/lora_left_out": float(sum(len(names) for names in t.left_out.values())),
        }


def check_coverage(peft_model: Any, targets: LoRATargets, allow_partial: bool = False) -> LoRACoverage:
    """Compare peft's record of what it adapted with ``targets``; raise on a shortfall unless
    ``allow_partial``."""
    tuner = peft_model.base_model
    adapted = set(tuner.targeted_module_names)
    adapted_parameters = set(getattr(tuner, "targeted_parameter_names", []))
    coverage = LoRACoverage(
        targets,
        [name for name in targets.modules if name not in adapted],
        [name for name in targets.parameters if name not in adapted_parameters],
    )
    missing = coverage.missing_modules + coverage.missing_parameters
    if missing and not allow_partial:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        cause = ""
        if targets.parameters and {n.rsplit(".", 1)[-1] for n in missing} <= PEFT_MOE_RENAMED:
            cause = (
                f" (peft turns targets named {', '.join(sorted(PEFT_MOE_RENAMED))} into the experts' fused "
                f"weights for {getattr(peft_model.config, 'model_type', 'this')} models, its conversion for "
                "adapters written for transformers 4, so no other module of those names can get an adapter "
                "that peft would load back)"
            )
        raise LoRACoverageError(
            f"{coverage.line()}: no adapter on {shown}{cause}. Name the modules to adapt in "
            "model.lora.target_modules, or set model.lora.allow_partial: true to train with the "
            "adapters peft placed"
        )
    return coverage
