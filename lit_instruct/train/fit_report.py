"""What a fit did, said in the terminal and the loggers: the model's size at the start, the totals at
the end (steps, tokens, time, best ``val/loss`` and its checkpoint, the time callbacks spent on work
of their own, the adapter and how to try it).

Installed by :class:`~lit_instruct.train.module.InstructLoRAModule` itself (``configure_callbacks``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_instruct.models.load import parameter_bytes


def logged_step(trainer: L.Trainer) -> int:
    """The step the loggers give what is logged now (the ``step`` column of ``metrics.csv``): the
    optimizer steps finished before the current one, so a validation after step ``n`` is logged at
    ``n - 1``. Lightning's own callbacks (``LearningRateMonitor``) read the same counter."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


@runtime_checkable
class FitCost(Protocol):
    """A callback that spends fit time on work of its own (generating samples, say), which the report
    shows: ``fit_cost()`` returns what the work is and its seconds in the current fit (0: no line)."""

    def fit_cost(self) -> tuple[str, float]: ...


@dataclass
class FitTotals:
    """What a fit went through, counted over all ranks."""

    seconds: float
    tokens: int
    response_tokens: int
    best_val_loss: float | None
    """The best of the objective's monitored held-out metric (``val/loss`` unless it says otherwise)."""
    best_val_step: int | None  # as the loggers show it (:func:`logged_step`)
    steps: int = -1
    """Optimizer steps this fit took (a resumed one: since the resume); -1 when not counted."""
    validated_before: float = 0.0
    """Seconds the validation before the fit took (``trainer.validate`` on the same Trainer)."""
    best_val_name: str = "val/loss"
    """The monitored metric's name."""


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def fit_summary(trainer: L.Trainer, totals: FitTotals, adapter: Path | None) -> str:
    """Steps, tokens, wall time, best val/loss and its checkpoint, the adapter and how to try it."""
    if totals.steps == 0:  # nothing trained: no adapter to try
        lines = [f"lit-instruct: fit done in {_duration(totals.seconds)}: it took no optimizer step"]
        if adapter is not None:
            lines.append(f"  adapter (untrained in this fit): {adapter}")
        return "\n".join(lines)
    resumed = totals.steps >= 0 and totals.steps != trainer.global_step
    steps = f"{trainer.global_step} optimizer steps" + (
        f" ({totals.steps} since the resume)" if resumed else ""
    )
    lines = [
        f"lit-instruct: fit done in {_duration(totals.seconds)}: {steps}, "
        f"{totals.tokens:,} tokens ({totals.response_tokens:,} response tokens) "
        f"({totals.tokens / max(totals.seconds, 1e-9):.0f} tokens/s over the whole fit)"
    ]
    skipped = trainer.callback_metrics.get("train/skipped_steps")  # logged by SkipNonFiniteSteps
    if skipped is not None and int(skipped):
        lines.append(f"  skipped steps (non-finite): {int(skipped)}")
    checkpoint = trainer.checkpoint_callback
    if (
        isinstance(checkpoint, ModelCheckpoint)
        and checkpoint.monitor == "val/loss"
        and checkpoint.best_model_path
        and checkpoint.best_model_score is not None
    ):
        best = f"  best val/loss {float(checkpoint.best_model_score):.4f}: {checkpoint.best_model_path}"
        best_adapter = getattr(checkpoint, "adapter_dir", None)
        if best_adapter is not None:
            best += f" (adapter: {best_adapter(checkpoint.best_model_path)})"
        lines.append(best)
    elif totals.best_val_loss is not None:
        name, value = totals.best_val_name, totals.best_val_loss
        lines.append(f"  best {name} {value:.4f} at step {totals.best_val_step} (as logged)")
    command = totals.seconds + totals.validated_before
    if totals.validated_before > 0:
        lines.append(
            f"  validation before the fit: {totals.validated_before:.1f} s "
            f"({totals.validated_before / command:.1%} of the command's {_duration(command)})"
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning at init, undeclared
        what, seconds = callback.fit_cost() if isinstance(callback, FitCost) else ("", 0.0)
        if seconds > 0:  # it did work in this fit
            share = seconds / max(totals.seconds, 1e-9)
            lines.append(f"  {what}: {seconds:.1f} s ({share:.1%} of the fit)")
    if adapter is not None:
        lines.append(f"  adapter: {adapter}")
        image = first_image(trainer)
        prompt = (
            f'--image {image} --prompt "Describe the image."'
            if image
            else '--prompt "Hello! What can you do?"'
        )
        lines.append(f"  try it:  {command_as_typed()} generate --adapter {adapter} {prompt}")
    return "\n".join(lines)


def first_image(trainer: L.Trainer) -> str | None:
    """The first image file the training samples show (``None``: text only, or a stream)."""
    data = getattr(trainer, "datamodule", None)
    if getattr(data, "processor", None) is None or getattr(data, "prepared", None) is None:
        return None
    for sample in data.prepared.train:  # type: ignore[union-attr]  # checked above
        image = next((i for i in sample.images if not i.startswith("data:")), None)
        if image is not None:
            return image
    return None


def command_as_typed() -> str:
    """``lit-instruct`` where a new shell finds this installation's command on ``PATH``, else its path
    in the environment it runs from (after ``make demo``: ``.venv/bin/lit-instruct``)."""
    import shutil
    import sys

    installed = Path(sys.executable).parent / "lit-instruct"
    found = shutil.which("lit-instruct", path=os.environ.get("PATH", ""))
    if found is not None and (not installed.exists() or Path(found).resolve() == installed.resolve()):
        return "lit-instruct"
    if installed.exists():
        try:
            return str(installed.relative_to(Path.cwd()))
        except ValueError:
            return str(installed)
    return f"{sys.executable} -m lit_instruct"


class FitReport(L.Callback):
    """At fit start: trainable and total parameters, base weight bytes (``model/*`` metrics too).
    During fit: the best of the objective's ``monitor`` (``val/loss``; GRPO: ``val/reward``), at the
    step the loggers show it. After fit (once the module has written its adapter): the summary of
    :func:`fit_summary`, with the time of each :class:`FitCost` callback.

    Reads the module's ``model`` (PEFT), ``tokens_seen``, ``response_tokens_seen`` and
    ``saved_adapter``, as :class:`~lit_instruct.train.module.InstructLoRAModule` has them.
    """

    def __init__(self) -> None:
        self._started = 0.0
        self.best_val: tuple[float, int] | None = None  # (the monitored metric, step)
        self.best_val_name = "val/loss"
        self.first_step = -1  # until training starts (it never does where max_steps is reached already)
        self.steps = 0
        self.validated_before = 0.0
        """Seconds of ``trainer.validate`` calls on this Trainer before its fit."""
        self._tokens_before = (0, 0)
        self._validating_since: float | None = None

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # a validate call, not a fit's validation
            self._validating_since = time.perf_counter()

        """Optimizer steps the last fit took (since its resume)."""

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_step = trainer.global_step  # a resumed fit's checkpoint is restored by now
        self._tokens_before = (  # a resumed fit's counts go on from the checkpoint's
            getattr(pl_module, "tokens_seen", 0),
            getattr(pl_module, "response_tokens_seen", 0),
        )

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()
        self.first_step = -1
        self._tokens_before = (0, 0)
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        total = sum(p.numel() for p in pl_module.parameters())
        base = parameter_bytes(getattr(pl_module, "model", pl_module))
        rank_zero_info(
            f"lit-instruct: {trainable:,} trainable of {total:,} parameters ({trainable / total:.2%}); "
            f"base weights {base['total'] / 1e6:.1f} MB "
            f"(4-bit linear layers {base['quantized_linear'] / 1e6:.1f} MB)"
        )
        metrics = {
            "model/trainable_params": float(trainable),
            "model/base_bytes": float(base["total"]),
            "model/quantized_linear_bytes": float(base["quantized_linear"]),
        }
        coverage = getattr(getattr(pl_module, "model", None), "lora_coverage", None)
        if coverage is not None:  # where the adapters are (lit_instruct.models.lora_targets)
            rank_zero_info(f"lit-instruct: {coverage.line()}")
            metrics.update(coverage.hparams())
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validating_since is not None:
            self.validated_before += time.perf_counter() - self._validating_since
            self._validating_since = None
        name, mode = getattr(getattr(pl_module, "objective", None), "monitor", ("val/loss", "min"))
        self.best_val_name = name
        value = trainer.callback_metrics.get(name)
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or value is None:
            return
        sign = 1.0 if mode == "min" else -1.0
        if self.best_val is None or sign * float(value) < sign * self.best_val[0]:
            self.best_val = (float(value), logged_step(trainer))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.steps = trainer.global_step - self.first_step if self.first_step >= 0 else 0
        if not trainer.is_global_zero:
            return
        best_loss, best_step = self.best_val or (None, None)
        seconds = time.perf_counter() - self._started
        tokens, response_tokens = (  # this fit's: a resumed one's time divides the tokens after it
            getattr(pl_module, "tokens_seen", 0) - self._tokens_before[0],
            getattr(pl_module, "response_tokens_seen", 0) - self._tokens_before[1],
        )
        totals = FitTotals(
            seconds,
            tokens,
            response_tokens,
            best_loss,
            best_step,
            self.steps,
            self.validated_before,
            getattr(self, "best_val_name", "val/loss"),
        )
        self.validated_before = 0.0  # counted once: a later fit on this Trainer starts anew
        rank_zero_info(fit_summary(trainer, totals, getattr(pl_module, "saved_adapter", None)))
