"""The reference model of an objective that has one: the policy's own weights with the adapter off
(peft's ``disable_adapter``: the fused LoRA layers then run peft's path, which skips the adapter),
or, when training continues from an SFT adapter, that adapter's weights as loaded, put in place of
the trained ones for the reference pass: no second copy of the base. In eval mode (no dropout)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def trainable_copy(model: Any) -> dict[str, torch.Tensor]:
    """A copy of the trainable weights as they are now (DTensors stay laid out as the parameters)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@contextmanager
def weights_in_place(model: Any, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``weights`` copied into the parameters of those names, the trained values put back after."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        trained = {name: params[name].detach().clone() for name in weights}
        for name, value in weights.items():
            params[name].copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in trained.items():
                params[name].copy_(value)


@contextmanager
def reference_pass(model: Any, adapter_weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """``model`` as the reference: eval mode, and the adapter off (or ``adapter_weights`` in place
    of the trained ones)."""
    was_training = model.training
    model.eval()
    try:
        if adapter_weights is None:
            with model.disable_adapter():
                yield
        else:
            with weights_in_place(model, adapter_weights):
                yield
    finally:
        model.train(was_training)
