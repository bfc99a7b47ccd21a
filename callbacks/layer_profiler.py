"""Per-layer forward/backward times and the phases of a training step, every N optimizer steps.

Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.LayerProfiler
          init_args: {every_n_steps: 10}
"""

from __future__ import annotations

import csv
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_instruct.callbacks.shared import figure, log_image
from lit_instruct.io import log_dir
from lit_instruct.models.decoder import decoder_of

PHASES = ("forward", "loss", "lm_head_backward", "layer_backward", "optimizer", "step")
"""Step phases: decoder trunk forward; loss (with a fused loss, its in-forward lm_head backward too);
backward from the loss to the final hidden state; backward through the decoder; clipping + optimizer
step + schedulers; and the whole optimizer step, from its first micro-batch to its end."""


class _Clock:
    """Timestamps: CUDA events on a GPU (no synchronisation until read), wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def decoder_layers(pl_module: L.LightningModule) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder trunk (embeddings to final norm) and its list of layers."""
    model: Any = getattr(pl_module, "base_model", pl_module)
    decoder = decoder_of(model) if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"LayerProfiler found no `layers` ModuleList in {type(decoder).__name__}")
    return decoder, layers


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    return output[0]


class LayerProfiler(L.Callback):
    """Times each decoder layer's forward and backward, and the phases of the step, every N steps.

    On a profiled step (``global_step % every_n_steps == every_n_steps - 1``, so the first, warm-up
    step is never one) hooks are put on the decoder and its layers for the whole accumulation window
    and taken off at its end: other steps run without any hook. Times come from CUDA events on a GPU
    (read once at the end of the step, no per-layer synchronisation) and the wall clock on a CPU.
    A layer's backward runs from the gradient reaching its output to the gradient reaching its input.

    Each profiled step logs ``profile/<phase>_ms`` and ``profile/layer_<i>_{forward,backward}_ms``
    (summed over the window's micro-batches). At the end of fit, rank 0 writes the means over
    profiled steps to ``layer_profile.{csv,json,png}`` in ``output_dir`` (default: the log directory)
    and logs the chart to W&B when W&B is a logger.

    Args:
        every_n_steps: profile one optimizer step in this many.
        output_dir: where the table and chart go.
    """

    def __init__(self, every_n_steps: int = 10, output_dir: str | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.output_dir = output_dir
        self.history: list[dict[str, float]] = []
        self._handles: list[RemovableHandle] = []
        self._micro_batches: list[dict[str, Any]] = []
        self._clock: _Clock | None = None

    def _require_clock(self) -> _Clock:
        if self._clock is None:
            raise RuntimeError("LayerProfiler: no clock before the Trainer's fit started")
        return self._clock

    @property
    def profiling(self) -> bool:
        return bool(self._handles)

    def _mark(self, key: str, once: bool = False) -> None:
        marks = self._micro_batches[-1]
        if not (once and key in marks):
            marks[key] = self._require_clock().mark()

    def _on_grad(self, key: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._mark(key, once=True)

        return hook

    def _attach(self, pl_module: L.LightningModule) -> None:
        decoder, layers = decoder_layers(pl_module)

        def recording(fn: Any) -> Any:  # forward hooks record only in training, not in a recompute
            def hook(module: nn.Module, args: Any, output: Any = None) -> None:
                if torch.is_grad_enabled() and self._micro_batches:
                    fn(output)

            return hook

        def timed(module: nn.Module, start: str, end: str, grad_reaches_output: str) -> None:
            """Mark ``start``/``end`` around ``module``'s forward, and ``grad_reaches_output`` when
            its output's gradient is computed in backward."""

            def on_output(output: Any) -> None:
                self._mark(end, once=True)
                hidden = _first_tensor(output)
                if hidden.requires_grad:
                    hidden.register_hook(self._on_grad(grad_reaches_output))

            self._handles += [
                module.register_forward_pre_hook(recording(lambda _: self._mark(start, once=True))),
                module.register_forward_hook(recording(on_output)),
            ]

        timed(decoder, "trunk_start", "trunk_end", "head_grad")
        for i, layer in enumerate(layers):
            timed(layer, f"fwd_start/{i}", f"fwd_end/{i}", f"bwd_start/{i}")
        self._num_layers = len(layers)

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.profiling and trainer.global_step % self.every_n_steps == self.every_n_steps - 1:
            self._clock = _Clock(pl_module.device)
            self._micro_batches = []
            self._profiled_step = trainer.global_step
            self._attach(pl_module)
        if self.profiling:
            self._micro_batches.append({})
            self._mark("batch_start")

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if self.profiling:
            self._mark("before_backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profiling:
            self._mark("after_backward")

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.profiling:
            self._mark("before_optimizer")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.profiling:
            return
        self._mark("batch_end")
        if trainer.global_step == self._profiled_step:  # the accumulation window goes on
            return
        self._detach()
        self._require_clock().synchronize()
        metrics = self._durations()
        self.history.append(metrics)
        if trainer.is_global_zero:
            logged = {f"profile/{name}_ms": value for name, value in metrics.items()}
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=self._profiled_step)

    def _durations(self) -> dict[str, float]:
        """Milliseconds per phase and per layer, summed over the window's micro-batches."""
        ms, total = self._require_clock().ms, defaultdict[str, float](float)
        first, last = self._micro_batches[0], self._micro_batches[-1]
        for m in self._micro_batches:
            total["forward"] += ms(m["trunk_start"], m["trunk_end"])
            total["loss"] += ms(m["trunk_end"], m["before_backward"])
            total["lm_head_backward"] += ms(m["before_backward"], m["head_grad"])
            total["layer_backward"] += ms(m["head_grad"], m["after_backward"])
            for i in range(self._num_layers):
                total[f"layer_{i}_forward"] += ms(m[f"fwd_start/{i}"], m[f"fwd_end/{i}"])
                input_grad = m[f"bwd_start/{i - 1}"] if i else m["after_backward"]
                total[f"layer_{i}_backward"] += ms(m[f"bwd_start/{i}"], input_grad)
        total["optimizer"] = ms(last["before_optimizer"], last["batch_end"])
        total["step"] = ms(first["batch_start"], last["batch_end"])
        return dict(total)

    def summary(self) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Mean phase times and one row per layer (``layer``, ``forward_ms``, ``backward_ms``)."""
        n = len(self.history)
        mean = {key: sum(h[key] for h in self.history) / n for key in self.history[0]}
        phases = {f"{phase}_ms": mean[phase] for phase in PHASES}
        layers = [
            {"layer": i, "forward_ms": mean[f"layer_{i}_forward"], "backward_ms": mean[f"layer_{i}_backward"]}
            for i in range(self._num_layers)
        ]
        return phases, layers

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._detach()
        directory = Path(self.output_dir) if self.output_dir else log_dir(trainer)  # every rank
        if not self.history or not trainer.is_global_zero:
            return
        directory.mkdir(parents=True, exist_ok=True)
        phases, layers = self.summary()
        with open(directory / "layer_profile.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["layer", "forward_ms", "backward_ms"])
            writer.writeheader()
            writer.writerows(layers)
        table = {"profiled_steps": len(self.history), "phases": phases, "layers": layers}
        (directory / "layer_profile.json").write_text(json.dumps(table, indent=2))
        log_image(
            trainer, "profile/layers", plot_layer_profile(phases, layers, directory / "layer_profile.png")
        )
        rank_zero_info(f"lit-instruct: layer profile of {len(self.history)} steps in {directory}")


def plot_layer_profile(phases: dict[str, float], layers: list[dict[str, float]], path: Path) -> Path:
    """A PNG: per-layer forward/backward bars, and the step's phases."""
    fig = figure(figsize=(12, 0.25 * len(layers) + 2.5))
    by_layer, by_phase = fig.subplots(1, 2, width_ratios=(3, 2))
    index = [row["layer"] for row in layers]
    forward = [row["forward_ms"] for row in layers]
    by_layer.barh(index, forward, label="forward")
    by_layer.barh(index, [row["backward_ms"] for row in layers], left=forward, label="backward")
    by_layer.set(xlabel="ms per step", ylabel="decoder layer", title="Per-layer time")
    by_layer.invert_yaxis()
    by_layer.legend()
    names = [name.removesuffix("_ms") for name in phases if name != "step_ms"]
    by_phase.barh(names, [phases[f"{name}_ms"] for name in names], color="tab:gray")
    by_phase.set(xlabel="ms per step", title=f"Step phases (step {phases['step_ms']:.0f} ms)")
    by_phase.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
