"""The objective: what a step trains. It turns a batch into its summed loss, the count that sum is
normalized by (response tokens, pairs, answers), and the sums of its per-unit metrics; the module
(:class:`~lit_instruct.train.module.InstructLoRAModule`) does everything else: the build, the window
that divides by the count of the whole accumulation window on all ranks, validation, the optimizer,
checkpoints and the adapter.

An objective declares what it needs (declared, never discovered by running it): the batch kind it
takes (:data:`~lit_instruct.batch.BatchKind`), whether it has a reference model, the names of its
metrics, and whether ``model.loss`` (the token cross-entropy) is the loss it computes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from lit_instruct.batch import BatchKind
from lit_instruct.errors import ConfigError
from lit_instruct.loss.contract import LossFn
from lit_instruct.loss.logits import LogitTransform


class Policy(Protocol):
    """What an objective may ask of the module it is trained in."""

    loss_fn: LossFn
    logit_transform: LogitTransform
    model: Any
    """The trained model (the adapter on its base): what online objectives sample from."""

    @property
    def trainer(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    def trunk(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def output_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def reference_model(self) -> AbstractContextManager[None]: ...

    def sampling_model(self, merged: bool = False) -> AbstractContextManager[Any]: ...

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ObjectiveSums:
    """One batch's contribution: ``loss_sum`` (with its graph) over ``count`` units, the sums of the
    objective's metrics over them (``(len(metric_names),)`` fp64; ``None``: it has none), the labelled
    tokens trained on, and the router's auxiliary loss of an MoE model (the module adds it, weighed
    by ``count``)."""

    loss_sum: torch.Tensor
    count: int
    metric_sums: torch.Tensor | None = None
    answer_tokens: int = 0
    aux: torch.Tensor | None = None


class Objective:
    """What is trained. Subclasses set the class attributes and implement :meth:`sums`; their
    ``__init__`` arguments are their settings (``model.objective.init_args``)."""

    name: ClassVar[str] = ""
    """The short name (``model.objective: dpo``) and what the model card calls the objective."""
    batch_kind: ClassVar[BatchKind] = "conversations"
    """What its batches hold: the data module reads the data so (the CLI links it)."""
    count_name: ClassVar[str] = "examples"
    """What the loss is averaged over, logged as ``train/<count_name>``."""
    val_count_name: ClassVar[str] = ""
    """Logged as ``val/<val_count_name>`` (default: ``count_name``)."""
    token_loss: ClassVar[bool] = False
    """Whether its loss is the token cross-entropy ``model.loss`` picks (else ``model.loss`` other
    than ``fused`` is refused, naming the objective)."""
    metric_names: tuple[str, ...] = ()
    """Its per-unit metrics, logged as ``train/<name>`` and ``val/<name>`` (means over the units)."""
    monitor: ClassVar[tuple[str, str]] = ("val/loss", "min")
    """The held-out metric that says how good the model is, and whether lower or higher is better
    (what the fit report calls the best validation)."""

    @property
    def needs_reference(self) -> bool:
        """Whether :meth:`sums` scores the batch with the reference model too."""
        return False

    @property
    def window_repeats(self) -> int:
        """For how many optimizer steps each window of batches trains (online RL's
        ``num_iterations``): the data module gives each window that many times in a row."""
        return 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's objective beyond its settings (a rollout reused
        by the steps after it)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`state_dict`'s."""

    def check(self, settings: Mapping[str, Any]) -> None:
        """Refuse a module setting (``settings``: the module's arguments by name) that cannot work with
        this objective, naming both (:class:`~lit_instruct.errors.ConfigError`): before any weight
        loads. Here: ``loss`` other than ``fused`` for an objective whose loss is not the token
        cross-entropy (subclasses add theirs, calling this one)."""
        loss = settings.get("loss", "fused")
        if isinstance(loss, Mapping):  # as parsed: {class_path: ..., init_args: ...}
            loss = loss.get("class_path")
        loss_name = loss if isinstance(loss, str) or loss is None else type(loss).__name__
        if not self.token_loss and loss_name not in (None, "fused"):
            raise ConfigError(
                "model.loss",
                f"{loss_name!r} cannot be combined with model.objective: {self.name or type(self).__name__}: "
                "model.loss is the token cross-entropy, and this objective scores answers its own way "
                "(leave model.loss unset)",
            )

    def sums(self, policy: Policy, batch: dict[str, Any]) -> ObjectiveSums:
        """The batch's summed loss, its count and metric sums."""
        raise NotImplementedError

    def metrics(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        """The logged metrics from a window's (or a validation's) metric sums over ``count`` units:
        each sum's mean over them (an objective with other denominators says its own)."""
        return {name: value / max(count, 1) for name, value in sums.items()}

    def validation_metrics(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        """Metrics derived from the held-out mean loss (SFT's perplexity), by name under ``val/``."""
        return {}

    def on_fit_start(self, policy: Policy) -> None:
        """Before the first step (e.g. precomputing reference values)."""

    def on_validation_start(self, policy: Policy) -> None:
        """Before each validation."""

    def settings(self) -> dict[str, Any]:
        """The ``__init__`` arguments as given (what a checkpoint and the model card keep):
        each parameter of ``__init__`` read from the attribute of the same name."""
        return {name: getattr(self, name) for name in init_parameters(type(self)) if hasattr(self, name)}

    def config(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}``: what rebuilds it (checkpoints)."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": self.settings()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


def init_parameters(cls: type) -> list[str]:
    """The names of ``cls.__init__``'s parameters (its settings), ``self`` and ``**kwargs`` left out."""
    parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return [
        p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def metric_sums(metrics: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """Each named per-unit metric summed over its units, in ``names``' order, fp64."""
    return torch.stack([metrics[name].double().sum() for name in names])
