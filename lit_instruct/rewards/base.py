"""Rewards named in YAML, and scoring completions with them without a silent zero.

A reward is any callable ``(prompts, completions, **columns) -> list[float | None]``, one value per
completion (``None``: it does not apply to that completion, as in TRL). ``columns`` are the record's
other fields (``answer``...), each a list aligned with the completions, and ``completion_ids``.
In YAML a reward is a shipped name (``exact_answer``), an import path (``my_rewards:score`` or
``my_rewards.score``), or ``{function: PATH}`` / ``{class_path: PATH, init_args: {...}}`` with an
optional ``weight`` (default 1) and ``name`` (its metric's name).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_instruct.errors import ConfigError, closest
from lit_instruct.rewards.shipped import SHIPPED, text_of

OnError = Literal["raise", "skip_group"]


class RewardError(RuntimeError):
    """A reward that raised, or returned other than one finite number (or ``None``) per completion."""


@dataclass(frozen=True)
class Reward:
    """A reward function, its weight and its name (logged as ``rewards/<name>/mean``)."""

    function: Callable[..., Any]
    weight: float = 1.0
    name: str = ""


def _import(path: str, setting: str) -> Any:
    """The object ``path`` (``module:attr`` or ``module.attr``) names."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            setting,
            f"{path!r} names no reward: a shipped one ({', '.join(SHIPPED)}){closest(path, list(SHIPPED))} "
            "or an import path (module:function)",
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module: any error importing it is theirs to see
        raise ConfigError(
            setting, f"{path!r}: module {module_name!r} does not import ({type(error).__name__}: {error})"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(setting, f"{path!r}: module {module_name!r} has no {attr!r}") from None


def _build(target: Any, init_args: Mapping[str, Any] | None, setting: str, path: str) -> Callable[..., Any]:
    """``target`` itself, or (a class, or ``init_args`` given) what calling it with them makes."""
    if isinstance(target, type) or init_args:
        try:
            target = target(**dict(init_args or {}))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{setting}.init_args", f"{path}: {error}") from None
    if not callable(target):
        raise ConfigError(setting, f"{path!r} is not callable: a reward is a function or a callable object")
    return target


def resolve_reward(spec: Any, setting: str) -> Reward:
    """One reward from its YAML form (or a callable, or a :class:`Reward`)."""
    if isinstance(spec, Reward):
        return spec
    if callable(spec) and not isinstance(spec, str):
        return Reward(spec, 1.0, getattr(spec, "__name__", type(spec).__name__))
    weight, name, init_args = 1.0, None, None
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"function", "class_path", "init_args", "weight", "name"}
        if unknown:
            raise ConfigError(
                setting,
                f"unknown key {sorted(unknown)[0]!r}: takes function or class_path, init_args, weight, name",
            )
        path = spec.get("function", spec.get("class_path"))
        weight, name, init_args = spec.get("weight", 1.0), spec.get("name"), spec.get("init_args")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{setting}.weight", f"must be a finite number, got {weight!r}")
    else:
        path = spec
    if not isinstance(path, str) or not path:
        raise ConfigError(setting, f"expected a reward's name or import path, got {spec!r}")
    target = SHIPPED[path] if path in SHIPPED else _import(path, setting)
    function = _build(target, init_args, setting, path)
    default_name = path if path in SHIPPED else path.replace(":", ".").rpartition(".")[2]
    return Reward(function, float(weight), str(name or default_name))


def resolve_rewards(specs: Any, setting: str = "model.objective.init_args.rewards") -> list[Reward]:
    """The rewards a YAML list names (one spec alone is a list of one); names made unique."""
    if specs is None or (isinstance(specs, Sequence) and not isinstance(specs, str) and not specs):
        raise ConfigError(setting, "needs at least one reward (e.g. exact_answer, or module:function)")
    if isinstance(specs, (str, Mapping, Reward)) or callable(specs):
        specs = [specs]
    rewards = [resolve_reward(spec, f"{setting}[{i}]") for i, spec in enumerate(specs)]
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise ConfigError(setting, f"two rewards are named {duplicate!r}: give one a name")
    return rewards


def score(
    rewards: Sequence[Reward],
    prompts: list[Any],
    completions: list[Any],
    columns: Mapping[str, list[Any]],
    num_generations: int,
    on_error: OnError = "raise",
) -> tuple[torch.Tensor, int]:
    """Each completion's value under each reward, ``(N, R)`` fp32 (NaN where a reward returned
    ``None``), and how many groups were skipped.

    A reward that raises, returns other than ``N`` values, or a value that is neither a finite
    number nor ``None`` raises :class:`RewardError` naming the reward and the first bad completion
    (its prompt and text); with ``on_error: skip_group`` the groups (``num_generations``
    consecutive completions) of the bad values are scored NaN instead and counted.
    """
    n = len(completions)
    table = torch.full((n, len(rewards)), float("nan"), dtype=torch.float32)
    bad_groups: set[int] = set()
    for column, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, **columns)
        except Exception as error:
            if on_error == "raise":
                raise RewardError(
                    f"reward {reward.name!r} raised {type(error).__name__}: {error} (scoring {n} "
                    f"completions, the first: {_describe(prompts, completions, 0)})"
                ) from error
            bad_groups.update(range(n // num_generations))
            continue
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise RewardError(
                f"reward {reward.name!r} returned {got} values for {n} completions: one per completion"
            )
        for row, value in enumerate(values):
            number = _number(value)
            if number is False:
                if on_error == "raise":
                    raise RewardError(
                        f"reward {reward.name!r} returned {value!r} for completion {row} "
                        f"({_describe(prompts, completions, row)}): a finite number, or None where it "
                        "does not apply"
                    )
                bad_groups.add(row // num_generations)
            elif number is not None:
                table[row, column] = number
    for group in bad_groups:
        table[group * num_generations : (group + 1) * num_generations] = float("nan")
    return table, len(bad_groups)


def _number(value: Any) -> float | Literal[False] | None:
    """``value`` as a finite float, ``None`` for ``None``, ``False`` for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    number = float(value)
    return number if math.isfinite(number) else False


def _describe(prompts: list[Any], completions: list[Any], row: int) -> str:
    """Completion ``row``'s prompt and text, shortened, for an error message."""

    def short(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= 60 else text[:57] + "..."

    prompt = prompts[row] if row < len(prompts) else ""
    prompt_text = text_of(prompt) if prompt else ""
    return f"prompt {short(prompt_text)!r}, completion {short(text_of(completions[row]))!r}"
