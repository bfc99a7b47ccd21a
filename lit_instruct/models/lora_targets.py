"""Where LoRA goes, and a check on the user's own model that peft put it there.

``target_modules: [all-linear]`` asks for every linear layer of the decoder (``nn.Linear`` and
transformers' ``Conv1D``; fused ``qkv_proj`` / ``gate_up_proj`` included) and every 3-D expert weight
of MoE layers, but the output head. A linear subclass of a class of its own (Falcon's ``FalconLinear``)
is adapted when its forward is the plain linear map of its weight and bias (checked on a probe input;
on the meta device it cannot be, and the build checks it again with weights); one whose forward is not
is an error that names it. Documented exclusions, named on the coverage line: the MoE routers we know
(``nn.Linear`` subclasses whose forward returns routing tuples: a LoRA layer around them fails), the
``out_proj`` of Mamba mixers (their fused kernels read the weight), layers whose weight the model reads
without calling them (found by a probe forward), and on a multimodal model everything outside its
language model. After peft has attached the adapters, what it adapted is compared with what was asked:
a shortfall or an adapter nobody asked for is an error that names the modules, never a silently
partial or misplaced adapter.

:func:`check_lora_names` checks every name a LoRA setting gives (target modules, layer indices,
rank and alpha pattern keys, ``modules_to_save``) against the model's names, without a forward pass,
so it also runs on a model built on the meta device.

peft rewrites targets named like the experts of transformers 4 (``gate_proj``, ``up_proj``,
``down_proj``, ``gate``, ``w1``-``w3``) into the fused expert weights of transformers 5 for some MoE
model types (DeepSeek, Qwen-MoE, Mixtral patterns), at training and at load, so a dense MLP or
shared expert so named could never carry a module adapter. Those layers are adapted through their
weight instead (peft's ``target_parameters``, which that rewrite leaves alone): the same update
``W + s * B @ A``, saved and loaded back by peft under the same names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lit_instruct.errors import ConfigError
from lit_instruct.models.decoder import decoder_of
from lit_instruct.models.weight_reads import weights_read_directly

if TYPE_CHECKING:
    from lit_instruct.models.lora import LoRAConfig

MAMBA_MODEL_TYPES = frozenset(
    {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h", "bamba", "granitemoehybrid", "zamba2"}
)
"""Model types whose Mamba ``out_proj`` weight the fused CUDA kernels read without calling the layer
(peft refuses the first five; transformers' Bamba, Granite 4 and Zamba2 mixers do the same)."""
PEFT_MOE_RENAMED = frozenset({"gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3"})
"""Target names peft's transformers-v4 MoE conversion turns into the experts' fused weights."""
KNOWN_ROUTERS = frozenset(
    {
        "transformers.models.llama4.modeling_llama4.Llama4Router",
        "transformers.models.phimoe.modeling_phimoe.PhimoeTopKRouter",
    }
)
"""``nn.Linear`` subclasses that are MoE routers: their forward returns routing tuples (a LoRA layer
around one fails), so they are left out by name."""
LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")
"""peft's rule for the decoder-layer index of a name (``layers_to_transform`` without
``layers_pattern``): the first numbered segment followed by a dot."""
PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-2}
"""How far (relative to the largest output) a linear subclass's output may be from ``F.linear`` and
still count as a plain linear map: matmul rounding, TF32 matmuls included for float32; 3e-2 for half
types. A forward that is not the linear map (scaled, biased otherwise, dequantized) is off by far more."""


class LoRACoverageError(ConfigError):
    """peft did not put an adapter exactly on the modules and expert weights that were asked for."""

    def __init__(self, message: str) -> None:
        super().__init__("model.lora.target_modules", message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


class LoRAConfigError(ConfigError):
    """A LoRA setting names something this model does not have, or a layer that cannot be adapted;
    the message is one line and starts with the setting (``model.lora.target_modules: ...``)."""

    def __init__(self, message: str) -> None:
        setting, _, rest = message.partition(": ")
        super().__init__(setting, rest)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self),))


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
    unprobed: list[str] = field(default_factory=list)
    """Linear subclasses taken for plain linear layers without a probe (no weights: meta device)."""
    peft_renamed: frozenset[str] = frozenset()
    """The target names peft rewrites into expert weights for this model."""
    left_out: dict[str, list[str]] = field(default_factory=dict)
    peft_modules: list[str] = field(default_factory=list)
    peft_parameters: list[str] = field(default_factory=list)

    def peft_keys(self) -> list[str]:
        """The names peft adapts and matches rank and alpha pattern keys against."""
        kept = [name for name in self.modules if name not in self.stuck]
        return kept + self.parameters + [f"{name}.weight" for name in self.by_weight]


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (bitsandbytes' 4-bit layers included) or transformers' ``Conv1D`` (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def _plain(module: nn.Module) -> bool:
    """Its class's forward is a linear layer's: ``nn.Linear``'s or ``Conv1D``'s own, or a
    bitsandbytes quantized linear's."""
    from transformers.pytorch_utils import Conv1D

    kind = type(module)
    return kind.forward in (nn.Linear.forward, Conv1D.forward) or kind.__module__.startswith("bitsandbytes")


def is_router(module: nn.Module) -> bool:
    """One of the :data:`KNOWN_ROUTERS` classes (or a subclass of one)."""
    return any(f"{kind.__module__}.{kind.__qualname__}" in KNOWN_ROUTERS for kind in type(module).__mro__)


def not_a_linear_map(module: nn.Module) -> str | None:
    """Why ``module``'s forward is not the plain linear map of its weight and bias (its output on a
    probe input compared with ``F.linear``, in training mode), or ``None`` when it is."""
    from transformers.pytorch_utils import Conv1D

    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    bias: torch.Tensor | None = getattr(module, "bias", None)
    if not weight.is_floating_point() or weight.element_size() < 2:
        return f"its weight is {weight.dtype}, not a float type F.linear takes"
    conv1d = isinstance(module, Conv1D)  # weight (in, out)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, weight.shape[0 if conv1d else 1], generator=generator)
    x = x.to(weight.device, weight.dtype)
    training = module.training
    module.train()
    try:
        with torch.no_grad():
            out = module(x)
            expected = nn.functional.linear(x, weight.T if conv1d else weight, bias)
    except Exception as failure:  # any forward that cannot take a plain linear input is not one
        return f"its forward fails on a linear layer's input ({type(failure).__name__})"
    finally:
        module.train(training)
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
        return f"its forward returns {type(out).__name__}, not the output of a linear layer"
    tolerance = PROBE_TOLERANCE.get(weight.dtype, 3e-2) * float(expected.abs().max())
    if float((out - expected).abs().max()) > tolerance:
        return "its output on a probe input is not F.linear(x, weight, bias)"
    return None


def _matches(name: str, target: str) -> bool:
    """peft's rule for a listed target: the full name, or its last dotted parts."""
    return name == target or name.endswith(f".{target}")


def layer_index(name: str) -> int | None:
    """The decoder-layer index of a module or parameter name, by peft's rule (:data:`LAYER_INDEX`)."""
    found = LAYER_INDEX.match(name)
    return int(found.group("idx")) if found else None


VisionLoRA = Literal["none", "projector", "all"]
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger", "vision_adapter")
"""Module names of the projectors that map image features into a decoder: LLaVA's, Gemma 3's and
Mistral 3's ``multi_modal_projector``, Idefics3's and SmolVLM's ``connector``, Qwen-VL's
``merger`` (and Qwen3-VL's ``deepstack_merger_list``), Llama 4's ``vision_adapter``."""


def is_projector(name: str) -> bool:
    """Whether module ``name`` lies inside a vision-language model's projector."""
    return any(part in PROJECTOR_NAMES or part.endswith("merger_list") for part in name.split("."))


def lora_targets(
    model: Any,
    target_modules: list[str],
    probe: bool = True,
    layers: Sequence[int] | None = None,
    vision: VisionLoRA = "none",
) -> LoRATargets:
    """The modules (and for ``all-linear`` the expert weights) that must get adapters, within the
    decoder layers numbered ``layers`` if given (``layers_to_transform``). ``probe``: run one forward
    to find the layers the model never calls (every rank must agree: ranks built on the meta device
    cannot run it, so a low-memory FSDP build skips it everywhere). A linear subclass is probed
    wherever it has weights: it is adapted or refused, the same placement on every rank.

    Raises:
        LoRAConfigError: a targeted linear subclass whose forward is not a plain linear map.
    """
    targets = candidates(model, target_modules, probe, vision)
    if layers is not None:
        targets = within_layers(targets, layers)
    return _finish(model, targets)


def candidates(
    model: Any, target_modules: list[str], probe: bool = False, vision: VisionLoRA = "none"
) -> LoRATargets:
    """The targets before the layer filter and the probe forward (names, classes and the linear
    subclasses' probe only).

    Raises:
        ConfigError: ``vision`` other than ``none`` with targets named, on a text-only model, or
            ``projector`` on a model whose projector has no name in :data:`PROJECTOR_NAMES`.
    """
    text = _language_model_prefix(model)
    _check_vision(model, vision, target_modules, text)
    if target_modules not in (["all-linear"], "all-linear"):
        asked = [
            (name, m) for name, m in model.named_modules() if any(_matches(name, t) for t in target_modules)
        ]
        targets = LoRATargets(modules=[], probed=probe)
        for name, module in asked:
            _sort(targets, name, module, None)
        return _check_linear_maps(model, targets)
    head = model.get_output_embeddings()
    mamba = getattr(model.config, "model_type", None) in MAMBA_MODEL_TYPES
    targets = LoRATargets(modules=[], probed=probe)
    for name, module in model.named_modules():
        if not is_linear(module) or module is head:
            continue
        reason = None
        if not name.startswith(text) and not (
            vision == "all" or (vision == "projector" and is_projector(name))
        ):
            reason = (
                "outside the language model (vision or audio tower, projector: model.lora.vision adapts them)"
            )
        elif mamba and name.rsplit(".", 1)[-1] == "out_proj":
            reason = "Mamba out_proj (the fused Mamba kernels read its weight, never calling the layer)"
        _sort(targets, name, module, reason)
    targets.parameters = sorted(
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        for name, p in module.named_parameters(recurse=False)
        if p.dim() == 3 and not isinstance(module, nn.Conv1d) and module_name.startswith(text)
    )
    return _check_linear_maps(model, targets)


def _check_vision(model: Any, vision: VisionLoRA, target_modules: list[str], text: str) -> None:
    if vision == "none":
        return
    if target_modules not in (["all-linear"], "all-linear"):
        raise ConfigError(
            "model.lora.vision",
            f"{vision} cannot be combined with model.lora.target_modules {target_modules} (it adds the "
            "vision layers to all-linear): set target_modules: [all-linear], or name the layers there",
        )
    if not text:
        raise ConfigError(
            "model.lora.vision",
            f"{vision}, but {type(model).__name__} is a text-only model (no vision tower): set none",
        )
    if vision == "projector" and not any(
        is_projector(name) and is_linear(m) for name, m in model.named_modules()
    ):
        raise ConfigError(
            "model.lora.vision",
            f"projector, but {type(model).__name__} has no linear layer in a module named "
            f"{', '.join(PROJECTOR_NAMES)}: set all, or name its layers in model.lora.target_modules",
        )


def _sort(targets: LoRATargets, name: str, module: nn.Module, reason: str | None) -> None:
    """Add ``name`` to the targets, or to what is left out (for ``reason``, or as a known router)."""
    if reason is None and is_linear(module) and is_router(module):
        reason = f"{type(module).__name__} (its forward is not a plain linear layer: a router)"
    if reason is None:
        targets.modules.append(name)
    else:
        targets.left_out.setdefault(reason, []).append(name)


def _check_linear_maps(model: Any, targets: LoRATargets) -> LoRATargets:
    """Probe the targeted linear subclasses that are not plain by class; refuse those that are not
    plain linear maps, by name; note those with no weights to probe."""
    modules = dict(model.named_modules())
    refused: dict[str, list[str]] = {}
    for name in targets.modules:
        module = modules[name]
        if not is_linear(module) or _plain(module):
            continue
        if module.weight.device.type == "meta":
            targets.unprobed.append(name)
        elif (why := not_a_linear_map(module)) is not None:
            refused.setdefault(f"{type(module).__name__} ({why})", []).append(name)
    if refused:
        shown = "; ".join(f"{kind}: {_some(names)}" for kind, names in refused.items())
        raise LoRAConfigError(
            f"model.lora.target_modules: linear layers of a class whose forward is not a plain linear layer, "
            f"which a LoRA adapter around them would not train as one: {shown}. Name the modules to adapt "
            "in model.lora.target_modules, leaving these out"
        )
    return targets


def within_layers(targets: LoRATargets, layers: Sequence[int]) -> LoRATargets:
    """``targets`` within the decoder layers numbered ``layers`` (peft's ``layers_to_transform`` rule,
    applied here to the expert weights and to what is left out as well)."""
    keep = {int(i) for i in layers}

    def within(names: list[str]) -> list[str]:
        return [name for name in names if layer_index(name) in keep]

    left_out = {reason: within(names) for reason, names in targets.left_out.items()}
    targets.modules = within(targets.modules)
    targets.parameters = within(targets.parameters)
    targets.unprobed = within(targets.unprobed)
    targets.left_out = {reason: names for reason, names in left_out.items() if names}
    return targets


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


def _finish(model: Any, targets: LoRATargets) -> LoRATargets:
    """Leave out the layers the model never calls; name the rest to peft so that it adapts exactly
    them."""
    linear = [name for name in targets.modules if is_linear(model.get_submodule(name))]
    for name in weights_read_directly(model, linear) if targets.probed else []:
        targets.modules.remove(name)
        leaf = name.rsplit(".", 1)[-1]
        reason = f"{leaf} (its parent reads the weight, never calling the layer: an adapter would not train)"
        targets.left_out.setdefault(reason, []).append(name)
    _adapt_renamed_by_weight(model, targets)
    names = [name for name, _ in model.named_modules() if name]
    targets.peft_modules = _peft_names(names, [n for n in targets.modules if n not in targets.stuck])
    parameters = [
        f"{m}.{p}" for m, module in model.named_modules() for p, _ in module.named_parameters(recurse=False)
    ]
    targets.peft_parameters = _peft_names(parameters, targets.parameters, parts=2) + [
        f"{name}.weight" for name in targets.by_weight
    ]
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


def _peft_names(names: list[str], asked: list[str], parts: int = 1) -> list[str]:
    """The shortest peft targets that match exactly ``asked`` (of ``names``): the last ``parts``
    dotted parts where every name so ending is asked for (``q_proj``, ``experts.down_proj``), else
    the full names (``altup_projections.0``, a router's twin, the layers of ``layers_to_transform``)."""
    wanted = set(asked)
    by_leaf: dict[str, list[str]] = {}
    for name in asked:
        by_leaf.setdefault(".".join(name.split(".")[-parts:]), []).append(name)
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
        if t.unprobed:
            text += (
                f" ({len(t.unprobed)} linear subclasses taken for plain linear layers, unprobed: no weights)"
            )
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
    ``allow_partial``, and on any adapter outside ``targets`` always."""
    tuner = peft_model.base_model
    adapted = set(tuner.targeted_module_names)
    adapted_parameters = set(getattr(tuner, "targeted_parameter_names", []))
    coverage = LoRACoverage(
        targets,
        [name for name in targets.modules if name not in adapted]
        + [name for name in targets.by_weight if f"{name}.weight" not in adapted_parameters],
        [name for name in targets.parameters if name not in adapted_parameters],
    )
    unasked = sorted(adapted - set(targets.modules)) + sorted(
        adapted_parameters - set(targets.parameters) - {f"{name}.weight" for name in targets.by_weight}
    )
    if unasked:
        raise LoRACoverageError(
            f"{coverage.line()}: peft also put adapters on {_some(unasked)}, which nobody asked for (not in "
            "model.lora.target_modules within model.lora.layers_to_transform): refusing misplaced adapters"
        )
    missing = coverage.missing_modules + coverage.missing_parameters
    if missing and not allow_partial:
        cause = ""
        if targets.peft_renamed and {n.rsplit(".", 1)[-1] for n in missing} <= targets.peft_renamed:
            cause = (
                f" (peft turns targets named {', '.join(sorted(targets.peft_renamed))} into the experts' "
                f"fused weights for {getattr(peft_model.config, 'model_type', 'this')} models, and a layer "
                "so named that is not a full-precision nn.Linear, such as a 4-bit one, cannot be adapted "
                "through its weight instead)"
            )
        raise LoRACoverageError(
            f"{coverage.line()}: no adapter on {_some(missing)}{cause}. Name the modules to adapt in "
            "model.lora.target_modules, or set model.lora.allow_partial: true to train with the "
            "adapters peft placed"
        )
    return coverage


def _some(names: Sequence[str], shown: int = 6) -> str:
    """``a, b, c and 4 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_lora_names(model: nn.Module, lora: LoRAConfig) -> None:
    """Refuse a LoRA setting that names nothing in ``model``: a target module that matches no module
    (with the closest names), a ``layers_to_transform`` index that is not one of its layers, a
    ``rank_pattern`` / ``alpha_pattern`` key that matches no targeted module, a ``modules_to_save``
    name that matches no module, or targets that leave nothing to adapt. Reads names only (no
    forward), so it runs on a model built on the meta device; :func:`attach_lora` runs it too.

    Raises:
        LoRAConfigError: one line, starting with the setting (``model.lora.target_modules: ...``).
    """
    names = [name for name, _ in model.named_modules() if name]
    linear = [name for name, module in model.named_modules() if is_linear(module)]
    if lora.vision != "none" and lora.layers_to_transform is not None:
        raise ConfigError(
            "model.lora.vision",
            f"{lora.vision} cannot be combined with model.lora.layers_to_transform (its indices are the "
            "decoder's layers; the vision tower's are numbered apart): set one of them",
        )
    _check_target_modules(names, linear, lora.target_modules)
    _check_modules_to_save(names, lora.modules_to_save)
    every = candidates(model, lora.target_modules, vision=lora.vision)
    if lora.layers_to_transform is not None:
        _check_layers(names, lora)
        every = within_layers(every, lora.layers_to_transform)
    check_targeted(_finish(model, every), lora)


def _check_target_modules(names: list[str], linear: list[str], target_modules: list[str]) -> None:
    if target_modules in (["all-linear"], "all-linear"):
        return
    if not target_modules:
        raise LoRAConfigError(
            "model.lora.target_modules is empty: name the modules to adapt, or [all-linear]"
        )
    unmatched = [t for t in target_modules if not any(_matches(name, t) for name in names)]
    if unmatched:
        raise LoRAConfigError(
            "model.lora.target_modules: "
            + "; ".join(
                f"{t!r} matches no module of this model ({_closest(t, names, linear)})" for t in unmatched
            )
            + ("; all-linear stands alone, as [all-linear]" if "all-linear" in unmatched else "")
        )


def _check_modules_to_save(names: list[str], modules_to_save: list[str]) -> None:
    """peft's rule for ``modules_to_save``: a module whose name ends with the entry."""
    unmatched = [m for m in modules_to_save if not any(name.endswith(m) for name in names)]
    if unmatched:
        raise LoRAConfigError(
            "model.lora.modules_to_save: "
            + "; ".join(
                f"{m!r} matches no module of this model ({_closest(m, names, names)})" for m in unmatched
            )
        )


def _check_layers(names: list[str], lora: LoRAConfig) -> None:
    """Every index a layer of the model; every listed target matching a module within them."""
    layers = lora.layers_to_transform or []
    if not layers:
        raise LoRAConfigError(
            "model.lora.layers_to_transform is empty: list layer indices, or leave it unset"
        )
    present = sorted({i for i in map(layer_index, names) if i is not None})
    absent = [i for i in layers if i not in present]
    if absent:
        raise LoRAConfigError(
            f"model.lora.layers_to_transform: {', '.join(map(str, absent))} "
            f"{'is not a layer' if len(absent) == 1 else 'are not layers'} of this model "
            f"(its layers: {_ranges(present)})"
        )
    if lora.target_modules in (["all-linear"], "all-linear"):
        return
    outside = [
        t for t in lora.target_modules if not any(_matches(n, t) and layer_index(n) in layers for n in names)
    ]
    if outside:
        raise LoRAConfigError(
            f"model.lora.target_modules: {', '.join(map(repr, outside))} "
            f"{'matches' if len(outside) == 1 else 'match'} no module within "
            f"model.lora.layers_to_transform {list(layers)}"
        )


def check_targeted(targets: LoRATargets, lora: LoRAConfig) -> None:
    """Something is left to adapt, and every ``rank_pattern`` / ``alpha_pattern`` key reaches every
    targeted layer it names, by peft's rule (``(.*\\.)?key$`` on the names peft adapts).

    Raises:
        LoRAConfigError: naming the setting and the key.
    """
    peft_keys = targets.peft_keys()
    if not peft_keys:
        left = "; ".join(f"{reason} x{len(names)}" for reason, names in targets.left_out.items())
        raise LoRAConfigError(
            f"model.lora.target_modules: {lora.target_modules} leave nothing to adapt"
            + (
                f" within model.lora.layers_to_transform {lora.layers_to_transform}"
                if lora.layers_to_transform
                else ""
            )
            + (f" (left out: {left})" if left else "")
        )
    for setting in ("rank_pattern", "alpha_pattern"):
        for key in getattr(lora, setting):
            _check_pattern_key(f"model.lora.{setting}", key, targets, peft_keys)


def _check_pattern_key(setting: str, key: str, targets: LoRATargets, peft_keys: list[str]) -> None:
    try:
        pattern = re.compile(rf"(.*\.)?({key})$")
    except re.error as failure:
        raise LoRAConfigError(f"{setting}: {key!r} is not a regular expression ({failure})") from failure
    named = [name for name in targets.by_weight if pattern.match(name)]
    if not named and not any(pattern.match(name) for name in peft_keys):
        closest = _closest(key, peft_keys, peft_keys)
        raise LoRAConfigError(f"{setting}: {key!r} matches no targeted module of this model ({closest})")
    missed = [name for name in named if not pattern.match(f"{name}.weight")]
    if missed:
        raise LoRAConfigError(
            f"{setting}: {key!r} does not reach {_some(missed)}, adapted through its weight (peft matches "
            f"the key against {missed[0]}.weight): write the key to match the weight, e.g. '{key}.weight'"
        )


def _closest(word: str, names: Iterable[str], fallback: Sequence[str]) -> str:
    """``closest: v_proj, o_proj``: the names (ending parts of as many dots as ``word``) difflib
    finds closest; else some of the ``fallback`` names' last parts."""
    parts = word.count(".") + 1
    endings = sorted({".".join(name.split(".")[-parts:]) for name in names})
    close = difflib.get_close_matches(word, endings, n=2)
    if close:
        return f"closest: {', '.join(close)}"
    leaves = sorted({name.rsplit(".", 1)[-1] for name in fallback if not name.rsplit(".", 1)[-1].isdigit()})
    return f"none close; its names include {_some(leaves)}" if leaves else "none close"


def _ranges(indices: list[int]) -> str:
    """``0-23`` for a contiguous run, else the indices."""
    if len(indices) > 1 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices)) or "none"
