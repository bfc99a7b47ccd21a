"""Strategies for devices and sharding; the loss is the module's own (``model.loss``).

``trainer.strategy: one_device`` (one device, following the Trainer's accelerator), ``ddp_lora``
(Lightning's DDP) or ``fsdp_lora`` (FSDP2 over the decoder layers, adapter-only checkpoints) in
YAML, registered by name by :func:`register_strategies` (which importing :mod:`lit_instruct.train`
runs). The names of the releases where these strategies installed the fused loss (``fused_ce``,
``fused_ce_ddp``, ``fused_ce_fsdp``, and their class names) stay as aliases.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)

from lit_instruct.errors import ConfigError
from lit_instruct.train.fsdp import HYBRID_DIMS, gathered_trainable_state


class OneDeviceStrategy(SingleDeviceStrategy):
    """One device; the device follows the Trainer's accelerator and devices
    unless one is given here.

    Raises:
        ValueError: when the Trainer asks for more than one device (use ``ddp_lora``).
    """

    strategy_name = "one_device"

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self._given = torch.device(device) if device is not None else None
        self._chosen: torch.device | None = None  # what the Trainer chose

    @property
    def root_device(self) -> torch.device:
        return self._given or self._chosen or super().root_device

    # Lightning's accelerator connector hands the devices it chose from ``accelerator`` / ``devices``
    # to any strategy with a ``parallel_devices`` attribute, and reads it back when the strategy was
    # given one (``_AcceleratorConnector._lazy_init_strategy``). A single-device strategy instance has
    # no other way to learn them; ``tests/test_strategy.py`` fails if Lightning stops doing this.
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The given device, else ``None`` so that the Trainer fills it in."""
        return [self._given] if self._given is not None else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"strategy one_device runs on one device, but the Trainer asks for {len(devices)} "
                f"({', '.join(map(str, devices))}): use strategy ddp_lora for several"
            )
        if devices:
            self._chosen = devices[0]


PROCESS_GROUP_TIMEOUT_MINUTES = 10.0
"""How long a rank waits in a collective for the others before it gives up (PyTorch's default is 30
minutes; NCCL's own watchdog then still hangs for as long): ``timeout_minutes`` of the strategies."""


def lost_rank_message(exception: BaseException) -> str | None:
    """One line for a rank whose peer died (a connection closed, or a timeout), else ``None``."""
    from torch.distributed import DistBackendError

    text = str(exception)
    lost = ("Connection closed by peer", "Connection reset by peer")  # gloo: the peer's socket is gone
    if not (
        isinstance(exception, DistBackendError)
        or (isinstance(exception, RuntimeError) and any(m in text for m in lost))
    ):
        return None
    first = text.strip().splitlines()[0][:300]
    return (
        "lit-instruct: another rank of this job was lost (killed, out of memory, or its node failed); "
        f"this rank stops too. Resume from the last checkpoint with --ckpt_path. ({first})"
    )


class _LostRankReport:
    """A strategy mixin: a rank whose peer died says so in one line before it stops."""

    def on_exception(self, exception: BaseException) -> None:
        message = lost_rank_message(exception)
        if message is not None:
            sys.stderr.write(message + "\n")
        super().on_exception(exception)  # type: ignore[misc]


class LoRADDPStrategy(_LostRankReport, DDPStrategy):
    """Lightning's DDP, under the name ``ddp_lora``; a collective waits ``timeout_minutes`` for
    the other ranks (default 10), and a rank whose peer died says so."""

    strategy_name = "ddp_lora"

    def __init__(self, timeout_minutes: float = PROCESS_GROUP_TIMEOUT_MINUTES, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", timedelta(minutes=timeout_minutes))
        super().__init__(**kwargs)


def hybrid_mesh(device_type: str, num_nodes: int, world_size: int) -> Any:
    """The ``(replicate, shard)`` device mesh of hybrid sharding: a row per node.

    Raises:
        ConfigError: fewer than 2 nodes, or ranks that do not divide over them.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if num_nodes < 2 or world_size % num_nodes:
        raise ConfigError(
            "trainer.strategy.hybrid",
            f"true shards within a node and replicates across nodes: it needs trainer.num_nodes >= 2 "
            f"dividing the {world_size} ranks, got {num_nodes} (one node: set hybrid: false)",
        )
    return init_device_mesh(device_type, (num_nodes, world_size // num_nodes), mesh_dim_names=HYBRID_DIMS)


class LoRAFSDPStrategy(_LostRankReport, ModelParallelStrategy):
    """Lightning's FSDP2 (``ModelParallelStrategy``, data parallel only) for LoRA and QLoRA.

    The module shards its base per decoder layer in ``configure_model`` (:mod:`lit_instruct.train.fsdp`);
    the loss gathers the lm_head weight it needs. Checkpoints hold the trainable (adapter) weights
    and their optimizer state only, gathered into one file on rank 0 (so they load on any number of
    ranks); the frozen base is never gathered.
    """

    strategy_name = "fsdp_lora"

    def __init__(
        self, hybrid: bool = False, timeout_minutes: float = PROCESS_GROUP_TIMEOUT_MINUTES, **kwargs: Any
    ) -> None:
        """``hybrid``: shard within each node and replicate across nodes (HSDP, a 2-D mesh of
        ``num_nodes`` x devices per node): each rank holds ``1/devices`` of the base, and only the
        gradients' all-reduce crosses nodes (not every layer's all-gather)."""
        kwargs.setdefault("save_distributed_checkpoint", False)
        kwargs.setdefault("timeout", timedelta(minutes=timeout_minutes))
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.hybrid = hybrid

    def setup_environment(self) -> None:
        self._data_parallel_size = (
            self.world_size
        )  # every rank one data-parallel shard (no tensor parallelism)
        super().setup_environment()
        if self.hybrid:
            self._device_mesh = hybrid_mesh(self.root_device.type, self.num_nodes, self.world_size)
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own share of the data, whatever the mesh's shape."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable weights, whole, on rank 0 (a collective: every rank calls it)."""
        assert self.model is not None
        return gathered_trainable_state(self.model)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load an adapter-only checkpoint (the frozen base is not in it, hence not strict)."""
        module = self.lightning_module
        assert module is not None
        strict, module.strict_loading = module.strict_loading, False
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        finally:
            module.strict_loading = strict


ALIASES = {"fused_ce": OneDeviceStrategy, "fused_ce_ddp": LoRADDPStrategy, "fused_ce_fsdp": LoRAFSDPStrategy}
"""Each strategy's former name (a config written for an earlier release still runs)."""
FusedCESingleDeviceStrategy, FusedCEDDPStrategy, FusedCEFSDPStrategy = ALIASES.values()  # former class paths


def register_strategies() -> None:
    """Register ``one_device``, ``ddp_lora`` and ``fsdp_lora`` (and their former names) in Lightning's
    strategy registry (idempotent)."""
    named = {cls.strategy_name: cls for cls in (OneDeviceStrategy, LoRADDPStrategy, LoRAFSDPStrategy)}
    for name, cls in {**named, **ALIASES}.items():
        if name not in StrategyRegistry:
            description = (cls.__doc__ or name).splitlines()[0]
            StrategyRegistry.register(name, cls, description=description)
