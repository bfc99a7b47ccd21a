"""Strategies that swap the module's loss for the fused linear cross-entropy, and do nothing else.

``trainer.strategy: fused_ce`` (one device) or ``fused_ce_ddp`` (DDP) in YAML, or
``Trainer(strategy=FusedCESingleDeviceStrategy(chunk_size=256))`` in Python. The module trains the
same without them, on its reference loss.
"""

from __future__ import annotations

from typing import Any, get_args

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lit_instruct.loss.fused import Backend, FusedLinearCrossEntropy


class FusedCEMixin:
    """Installs :class:`FusedLinearCrossEntropy` as ``lightning_module.loss_fn`` at setup.

    Args:
        chunk_size: token rows per chunk (default: a 512 MiB fp32 logits workspace).
        backend: ``auto`` (triton on CUDA when installed, else torch), ``torch`` or ``triton``.
    """

    def __init__(self, *args: Any, chunk_size: int | None = None, backend: Backend = "auto", **kwargs: Any):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if backend not in get_args(Backend):
            raise ValueError(f"backend must be one of {get_args(Backend)}, got {backend!r}")
        super().__init__(*args, **kwargs)
        self.loss = FusedLinearCrossEntropy(chunk_size=chunk_size, backend=backend)

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        module = self.lightning_module  # type: ignore[attr-defined]
        if not hasattr(module, "loss_fn"):
            raise TypeError(f"{type(module).__name__} has no `loss_fn` for the fused_ce strategy to replace")
        module.loss_fn = self.loss


class FusedCESingleDeviceStrategy(FusedCEMixin, SingleDeviceStrategy):
    """One device with the fused loss; the device follows the Trainer's accelerator and devices."""

    strategy_name = "fused_ce"

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Set by the Trainer: the root device is the first of the devices it chose."""
        return [self.root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and not self._device_given:
            self._root_device = devices[0]


class FusedCEDDPStrategy(FusedCEMixin, DDPStrategy):
    """Lightning's DDP with the fused loss."""

    strategy_name = "fused_ce_ddp"


def register_strategies() -> None:
    """Register ``fused_ce`` and ``fused_ce_ddp`` in Lightning's strategy registry (idempotent)."""
    for cls in (FusedCESingleDeviceStrategy, FusedCEDDPStrategy):
        if cls.strategy_name not in StrategyRegistry:
            StrategyRegistry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])


register_strategies()
