"""Find linear layers whose parent reads the weight instead of calling the layer.

A LoRA adapter wraps a layer's ``forward``; a model that computes ``layer.weight @ x`` itself (Jamba's
``dt_proj``, Gemma 3n's AltUp ``correction_coefs``) never calls it, so an adapter there would train
nothing. One short forward of the user's own model under a ``TorchFunctionMode`` sees every op that
takes a layer's weight while that layer is not running.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

PROBE_TOKENS = 8


class _WeightReads(TorchFunctionMode):
    """Records the layers whose weight an op takes while the layer's own forward is not running."""

    def __init__(self, layers: dict[int, str]) -> None:
        super().__init__()
        self.layers = layers
        self.running: list[str] = []
        self.called: set[str] = set()
        self.read_outside: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":  # an attribute read (``.data``) is no use
            for value in (*args, *kwargs.values()):
                name = self.layers.get(id(value)) if isinstance(value, torch.Tensor) else None
                if name is not None and (not self.running or self.running[-1] != name):
                    self.read_outside.add(name)
        return func(*args, **kwargs)


@contextmanager
def _tracking(mode: _WeightReads, modules: dict[str, nn.Module]) -> Iterator[None]:
    def enter(name: str) -> Any:
        def hook(*_: Any) -> None:
            mode.running.append(name)
            mode.called.add(name)

        return hook

    def leave(*_: Any) -> None:
        mode.running.pop()

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def weights_read_directly(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Those of ``names`` (linear layers of ``model``) whose weight the model's training-mode forward
    uses without ever calling the layer (Gemma 3n does so in training only), in ``names`` order."""
    if not names:
        return []
    all_modules = dict(model.named_modules())
    modules = {name: all_modules[name] for name in names}
    mode = _WeightReads({id(module.weight): name for name, module in modules.items()})
    device = next(model.parameters()).device
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device).unsqueeze(0)
    training = model.training
    model.train()
    try:
        with torch.no_grad(), _tracking(mode, modules), mode:
            model(input_ids=ids, use_cache=False)
    finally:
        model.train(training)
    return [name for name in names if name in mode.read_outside and name not in mode.called]
