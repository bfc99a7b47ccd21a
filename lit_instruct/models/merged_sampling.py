"""Sampling with the adapters merged into copies of their base weights: one GEMM per projection in
each decoding step instead of the base's and LoRA's two skinny ones (and their casts), the base weights
themselves never written.

A merged layer computes ``x @ (W + scaling * B @ A)^T``, the sum taken in fp32 and kept in the base's
dtype: in fp32 that is LoRA's own result up to float rounding; in bf16 the merged weight is rounded to
bf16 once, where the unmerged path rounds ``W x`` and ``B A x`` apart (each a bf16 GEMM under autocast).
Layers it cannot merge so (4-bit or sharded bases, DoRA, several adapters, expert weights) keep
LoRA's path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _mergeable(layer: nn.Module) -> bool:
    """A PEFT LoRA ``Linear`` with one plain adapter over a whole float ``nn.Linear``."""
    from peft.tuners.lora.layer import Linear as LoRALinear

    if type(layer) is not LoRALinear or layer.disable_adapters or layer.merged:
        return False
    adapters = layer.active_adapters
    if len(adapters) != 1 or adapters[0] in layer.lora_variant or adapters[0] not in layer.lora_A:
        return False
    base = layer.base_layer
    if type(base) is not nn.Linear or base.weight.requires_grad:
        return False
    weight = base.weight
    return type(weight) in (nn.Parameter, torch.Tensor) and weight.dtype.is_floating_point


@contextmanager
def merged_adapters(model: nn.Module) -> Iterator[int]:
    """For the while, each mergeable LoRA layer of ``model`` computes with its merged weight, a new
    tensor (PEFT's own merged state routes the call; the fused LoRA layers step aside for a merged
    layer); the base weights are put back as they were, untouched. Yields how many layers merged."""
    swapped: list[tuple[Any, Any, Any, str]] = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not _mergeable(module):
                    continue
                layer: Any = module  # a PEFT LoRA Linear
                name = layer.active_adapters[0]
                base = layer.base_layer
                weight = base.weight
                merged = (weight.float() + layer.get_delta_weight(name).float()).to(weight.dtype)
                base.weight = nn.Parameter(merged, requires_grad=False)
                layer.merged_adapters.append(name)
                swapped.append((layer, base, weight, name))
        yield len(swapped)
    finally:
        for layer, base, weight, name in swapped:
            base.weight = weight
            layer.merged_adapters.remove(name)
