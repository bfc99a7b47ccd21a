"""The plan ``lit-instruct check`` prints: the model and its adapters, the data, the steps, and an
estimate of the training step's peak memory, all without reading a weight."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lit_instruct.preflight import ModelPlan

RUNTIME_BYTES = 630 * 2**20
"""Python, torch, transformers, peft and Lightning loaded (the demo's build phase less its base)."""
ADAM_BYTES_PER_TRAINABLE = 16
"""fp32 weight, gradient and AdamW's two moments."""
FOUR_BIT_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}
"""Bytes per 4-bit weight with its block scales (64 weights a block), by double quantization."""


def activation_floats_per_token(plan: ModelPlan) -> int:
    """Values a decoder layer keeps for backward per token: about 8 of the hidden width (norms,
    attention inputs and output) and 4 of the MLP's (gate, up, activation, product); 10,752 for
    SmolLM2-135M, whose measured 2.7 GB for 2,048 tokens over 30 layers is 10,990 fp32 values."""
    return 8 * plan.hidden + 4 * (plan.intermediate or 4 * plan.hidden)


@dataclass
class MemoryEstimate:
    """A training step's peak resident memory, by part (bytes)."""

    runtime: int
    base: int
    adapters: int
    activations: int

    @property
    def total(self) -> int:
        return self.runtime + self.base + self.adapters + self.activations


def rows_per_item(settings: Mapping[str, Any]) -> int:
    """Rows of a batch per ``data.batch_size`` item: 2 for preference pairs (the chosen and the
    rejected answer) and for labelled answers (each beside its KL estimate's mismatched one), else 1."""
    kind = settings.get("data.batch_kind") or ("pairs" if settings.get("model.preference") else None)
    return 1 if kind in (None, "conversations") else 2


def estimate_memory(plan: ModelPlan, settings: Mapping[str, Any]) -> MemoryEstimate:
    """The peak of a training step on the longest batch (``batch_size`` x ``max_seq_len`` tokens, twice
    that for preference pairs; their reference pass runs without gradients and keeps no activations)."""
    quantized = settings.get("model.quantization.method", "none") != "none"
    weight_dtype = (
        settings.get("model.quantization.compute_dtype") if quantized else settings.get("model.dtype")
    )
    width = 2 if weight_dtype in ("bfloat16", "float16") else 4
    base = plan.parameters * width
    if quantized:
        per_weight = FOUR_BIT_BYTES[bool(settings.get("model.quantization.double_quant", True))]
        base += int(plan.quantized_linear * (per_weight - width))
    activation_width = 2 if str(settings.get("trainer.precision", "32")).startswith(("bf16", "16")) else 4
    rows = int(settings.get("data.batch_size", 8)) * rows_per_item(settings)
    tokens = rows * int(settings.get("data.max_seq_len", 512))
    per_layer = tokens * activation_floats_per_token(plan) * activation_width
    layers = plan.layers
    if settings.get("model.gradient_checkpointing"):
        kept = settings.get("model.checkpoint_layers")
        recomputed = layers if kept is None else min(layers, int(kept))
        inputs = tokens * plan.hidden * activation_width * recomputed
        activations = per_layer * (layers - recomputed + 1) + inputs
    else:
        activations = per_layer * layers
    return MemoryEstimate(RUNTIME_BYTES, base, plan.trainable * ADAM_BYTES_PER_TRAINABLE, activations)


def optimizer_steps(samples: int, settings: Mapping[str, Any]) -> int | None:
    """The fit's optimizer steps: ``trainer.max_steps``, else epochs of ``samples`` over the ranks, each
    window ``num_iterations`` times (Lightning's 1000 epochs when neither is set; ``None`` for
    ``max_epochs: -1``, no limit)."""
    max_steps = settings.get("trainer.max_steps", -1)
    if max_steps not in (None, -1):
        return int(max_steps)
    epochs = settings.get("trainer.max_epochs")
    epochs = 1000 if epochs is None else epochs
    if epochs == -1:
        return None
    devices = settings.get("trainer.devices", 1)
    world = (devices if isinstance(devices, int) and devices > 0 else 1) * int(
        settings.get("trainer.num_nodes", 1)
    )
    batches = math.ceil(samples / (int(settings.get("data.batch_size", 8)) * world))
    repeats = int(settings.get("model.objective.init_args.num_iterations") or 1)  # online RL's windows
    windows = math.ceil(batches / int(settings.get("trainer.accumulate_grad_batches", 1)))
    return int(epochs) * windows * repeats


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def plan_text(plan: ModelPlan, settings: Mapping[str, Any], samples: int | None, tokens: int | None) -> str:
    """The lines ``lit-instruct check`` prints."""
    memory = estimate_memory(plan, settings)
    steps = optimizer_steps(samples, settings) if samples is not None else settings.get("trainer.max_steps")
    pairs = rows_per_item(settings) == 2
    items = "answers" if settings.get("data.batch_kind") == "unpaired" else "pairs"  # KTO: each with a KL row
    batch_size, length = settings.get("data.batch_size", 8), settings.get("data.max_seq_len")
    if samples is None:
        data = "streamed"
    else:
        data = f"{samples:,} {items} ({2 * samples:,} rows)" if pairs else f"{samples:,} samples"
        data += f", {tokens:,} tokens"
    rows = (
        f"{2 * batch_size} x {length} batch ({batch_size} {items})"
        if pairs
        else f"{batch_size} x {length} batch"
    )
    lines = [
        f"model: {settings['model.model']} ({plan.model_type}, {plan.parameters:,} parameters) "
        f"from {plan.source}",
        f"adapters: {plan.coverage}; {plan.trainable:,} trainable parameters",
        f"data [train]: {data}; {steps if steps is not None else 'unbounded'} optimizer steps",
        f"peak memory estimate: {_gib(memory.total)} (runtime {_gib(memory.runtime)}, "
        f"base {_gib(memory.base)}, adapters and AdamW {_gib(memory.adapters)}, activations of a "
        f"{rows} {_gib(memory.activations)})",
    ]
    return "".join(f"lit-instruct check: {line}\n" for line in lines)
