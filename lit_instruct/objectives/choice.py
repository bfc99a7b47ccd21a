"""``model.objective``: a short name, a ``class_path`` (short name, class name or import path) with
its ``init_args``, or an :class:`~lit_instruct.objectives.base.Objective`; the old ``model.preference``
form still works, and says how to write the new one."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

from lit_instruct.batch import BatchKind
from lit_instruct.errors import ConfigError, closest
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.objectives.base import Objective
from lit_instruct.objectives.kto import KTO
from lit_instruct.objectives.online import GRPO, RLOO
from lit_instruct.objectives.pairs import DPO, IPO, ORPO, PairObjective, SimPO
from lit_instruct.objectives.sft import SFT

ObjectiveName = Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto", "grpo", "rloo"]
OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (SFT, DPO, IPO, SimPO, ORPO, KTO, GRPO, RLOO)
}
"""The objectives by short name."""


def objective_class(path: str) -> type[Objective]:
    """The class ``path`` names: a short name (``dpo``), a class name (``DPO``) or an import path."""
    if path in OBJECTIVES:
        return OBJECTIVES[path]
    by_class = {cls.__name__: cls for cls in OBJECTIVES.values()}
    if path in by_class:
        return by_class[path]
    module_name, _, class_name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError):
        found = None
    if not (isinstance(found, type) and issubclass(found, Objective)):
        raise ConfigError(
            "model.objective.class_path",
            f"{path!r} is no objective: a short name ({', '.join(OBJECTIVES)})"
            f"{closest(path, list(OBJECTIVES))} or the import path of an Objective subclass",
        )
    return found


_SAID: set[str] = set()


def say_new_form(objective: PairObjective) -> None:
    """Say (once per process: the check and the build both read it) how to write the old
    ``model.preference`` settings as ``model.objective``."""
    defaults = type(objective)().settings()
    args = ", ".join(f"{k}: {v}" for k, v in objective.settings().items() if v != defaults.get(k))
    line = f"model.objective: {objective.name}"
    if args:
        line = f"model.objective: {{class_path: {type(objective).__name__}, init_args: {{{args}}}}}"
    if line not in _SAID:
        _SAID.add(line)
        rank_zero_info(f"lit-instruct: model.preference is the old form of model.objective; write {line}")


def resolve_objective(value: Any = None, preference: Any = None) -> Objective:
    """The objective ``model.objective`` names (``None``: SFT), or the pair objective of the old
    ``model.preference`` settings (said once, with the new form)."""
    if preference is not None:
        if value is not None:
            raise ConfigError(
                "model.preference", "is the old form of model.objective: set only model.objective"
            )
        objective = PairObjective.from_preference(preference)
        say_new_form(objective)
        return objective
    if value is None:
        return SFT()
    if isinstance(value, Objective):
        return value
    if isinstance(value, str):
        if value not in OBJECTIVES:
            raise ConfigError(
                "model.objective",
                f"{value!r} is none of {', '.join(OBJECTIVES)}{closest(value, list(OBJECTIVES))} "
                "(or give a class_path)",
            )
        return OBJECTIVES[value]()
    if isinstance(value, Mapping) and "class_path" in value:
        cls = objective_class(str(value["class_path"]))
        init_args = dict(value.get("init_args") or {})
        try:
            return cls(**init_args)
        except TypeError as error:
            raise ConfigError("model.objective.init_args", f"{cls.__name__}: {error}") from None
    if isinstance(value, (PreferenceConfig, Mapping)):
        return resolve_objective(preference=value)
    raise ConfigError("model.objective", f"expected a name or a class_path, got {value!r}")


def batch_kind_of(value: Any = None, preference: Any = None) -> BatchKind:
    """The batch kind of the objective ``model.objective`` names (as parsed: a short name, or a
    ``class_path`` mapping), without building it; ``conversations`` for a value that names no
    objective (building it then refuses the value, naming it)."""
    if preference is not None:
        return "pairs"
    if isinstance(value, Objective):
        return value.batch_kind
    path = value.get("class_path") if isinstance(value, Mapping) else getattr(value, "class_path", value)
    if not isinstance(path, str):
        return "conversations"
    try:
        return objective_class(path).batch_kind
    except ConfigError:
        return "conversations"
