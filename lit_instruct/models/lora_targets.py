"""Where LoRA goes, and a check on the user's own model that peft put it there.

``target_modules: [all-linear]`` asks for every linear layer of the decoder (``nn.Linear`` and
transformers' ``Conv1D``; fused ``qkv_proj`` / ``gate_up_proj`` included) and every 3-D expert weight
of MoE layers, but the output head. Documented exclusions, named on the coverage line: linear
subclasses whose forward is not a plain linear layer (MoE routers that return routing tuples: a LoRA
layer around them fails), the ``out_proj`` of Mamba mixers (their fused kernels read the weight),
layers whose weight the model reads without calling them (found by a probe forward), and on a
multimodal model everything outside its language model. After peft has attached the adapters,
what it adapted is compared with what was asked: a shortfall is an error that names the modules,
never a silently partial adapter.

peft rewrites targets named like the experts of transformers 4 (``gate_proj``, ``up_proj``,
``down_proj``, ``gate``, ``w1``-``w3``) into the fused expert weights of transformers 5 for some MoE
model types (DeepSeek, Qwen-MoE, Mixtral patterns), at training and at load, so a dense MLP or
shared expert so named could never carry a module adapter. Those layers are adapted through their
weight instead (peft's ``target_parameters``, which that rewrite leaves alone): the same update
``W + s * B @ A``, saved and loaded back by peft under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_instruct.models.decoder import decoder_of
from lit_instruct.models.weight_reads import weights_read_directly

MAMBA_MODEL_TYPES = frozenset(
    {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h", "bamba", "granitemoehybrid", "zamba2"}
)
"""Model types whose Mamba ``out_proj`` weight the fused CUDA kernels read without calling the layer
(peft refuses the first five; transformers' Bamba, Granite 4 and Zamba2 mixers do the same)."""
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
    by_weight: list[str] = field(default_factory=list)
    """Linear layers adapted through their weight (names peft would rewrite into expert targets)."""
    stuck: list[str] = field(default_factory=list)
    """Layers so named that cannot be adapted through their weight (4-bit ones): not given to peft,
    so the coverage check names them."""
    probed: bool = True
    """Whether a forward looked for layers whose weight the model reads without calling them."""
    peft_renamed: frozenset[str] = frozenset()
    """The target names peft rewrites into expert weights for this model."""
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


def lora_targets(model: Any, target_modules: list[str], probe: bool = True) -> LoRATargets:
    """The modules (and for ``all-linear`` the expert weights) that must get adapters. ``probe``:
    run one forward to find the layers the model never calls (every rank must agree: ranks built
    on the meta device cannot run it, so a low-memory FSDP build skips it everywhere)."""
    names = [name for name, _ in model.named_modules() if name]
    if target_modules not in (["all-linear"], "all-linear"):
        asked = [name for name in names if any(_matches(name, t) for t in target_modules)]
        return _finish(model, names, LoRATargets(modules=asked, probed=probe))
    head = model.get_output_embeddings()
    mamba = getattr(model.config, "model_type", None) in MAMBA_MODEL_TYPES
    text = _language_model_prefix(model)
    targets = LoRATargets(modules=[], probed=probe)
    for name, module in model.named_modules():
        if not is_linear(module) or module is head:
            continue
        if not name.startswith(text):
            reason = "outside the language model (vision or audio tower, projector: text never reaches it)"
        elif mamba and name.rsplit(".", 1)[-1] == "out_proj":
            reason = "Mamba out_proj (the fused Mamba kernels read its weight, never calling the layer)"
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
        if p.dim() == 3 and not isinstance(module, nn.Conv1d) and module_name.startswith(text)
    }
    targets.parameters = sorted(experts)
    targets.peft_parameters = sorted(set(experts.values()))
    return _finish(model, names, targets)


def _language_model_prefix(model: Any) -> str:
    """``model.language_model.`` for a multimodal model (its text decoder), ``""`` for a causal LM
    whose decoder is all there is besides the head."""
    try:
        decoder = decoder_of(model)
    except (AttributeError, NotImplementedError):
        return ""
    name = next((n for n, m in model.named_modules() if m is decoder), "")
    config = getattr(model, "config", None)
    multimodal = config is not None and getattr(config, "text_config", None) not in (None, config)
    return f"{name}." if name and multimodal else ""


def _finish(model: Any, names: list[str], targets: LoRATargets) -> LoRATargets:
    """Leave out the layers the model never calls; name the rest to peft so that it adapts them."""
    linear = [name for name in targets.modules if is_linear(model.get_submodule(name))]
    for name in weights_read_directly(model, linear) if targets.probed else []:
        targets.modules.remove(name)
        leaf = name.rsplit(".", 1)[-1]
        reason = f"{leaf} (its parent reads the weight, never calling the layer: an adapter would not train)"
        targets.left_out.setdefault(reason, []).append(name)
    _adapt_renamed_by_weight(model, targets)
    targets.peft_modules = _peft_names(names, [n for n in targets.modules if n not in targets.stuck])
    return targets


def peft_renamed_targets(model: Any) -> frozenset[str]:
    """The target names peft rewrites into expert weights for ``model`` (empty for most models):
    peft's own conversion, run on a probe config."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:  # a peft without the transformers-5 rewrite
        return frozenset()
    probe = LoraConfig(target_modules=sorted(PEFT_MOE_RENAMED))
    convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    return PEFT_MOE_RENAMED - set(probe.target_modules or ())


def _adapt_renamed_by_weight(model: Any, targets: LoRATargets) -> None:
    """Move the full-precision ``nn.Linear`` targets peft would rewrite to ``target_parameters``;
    others so named (4-bit layers) are kept from peft, and the coverage check names them."""
    renamed = targets.peft_renamed = peft_renamed_targets(model) if targets.modules else frozenset()
    if not renamed:
        return
    modules = dict(model.named_modules())
    for name in list(targets.modules):
        module = modules[name]
        if name.rsplit(".", 1)[-1] not in renamed:
            continue
        if type(module) is nn.Linear:
            targets.modules.remove(name)
            targets.by_weight.append(name)
        else:
            targets.stuck.append(name)
    targets.peft_parameters += [f"{name}.weight" for name in targets.by_weight]


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
        asked = len(t.modules) + len(t.by_weight)
        text = f"LoRA: {asked - len(self.missing_modules)} of {asked} linear layers"
        if t.parameters:
            adapted = len(t.parameters) - len(self.missing_parameters)
            text += f", {adapted} of {len(t.parameters)} expert weights"
        left = [f"{reason} x{len(names)}" for reason, names in t.left_out.items()]
        text += f" (left out: {'; '.join(left)})" if left else ""
        return text + ("" if t.probed else " (layers the model never calls not probed: low_memory_load)")

    def hparams(self) -> dict[str, float]:
        t = self.targets
        asked = len(t.modules) + len(t.by_weight)
        return {
            "model/lora_linear_asked": float(asked),
            "model/lora_linear_adapted": float(asked - len(self.missing_modules)),
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
        [name for name in targets.modules if name not in adapted]
        + [name for name in targets.by_weight if f"{name}.weight" not in adapted_parameters],
        [name for name in targets.parameters if name not in adapted_parameters],
    )
    missing = coverage.missing_modules + coverage.missing_parameters
    if missing and not allow_partial:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        cause = ""
        if targets.peft_renamed and {n.rsplit(".", 1)[-1] for n in missing} <= targets.peft_renamed:
            cause = (
                f" (peft turns targets named {', '.join(sorted(targets.peft_renamed))} into the experts' "
                f"fused weights for {getattr(peft_model.config, 'model_type', 'this')} models, and a layer "
                "so named that is not a full-precision nn.Linear, such as a 4-bit one, cannot be adapted "
                "through its weight instead)"
            )
        raise LoRACoverageError(
            f"{coverage.line()}: no adapter on {shown}{cause}. Name the modules to adapt in "
            "model.lora.target_modules, or set model.lora.allow_partial: true to train with the "
            "adapters peft placed"
        )
    return coverage
