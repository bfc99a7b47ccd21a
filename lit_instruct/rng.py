"""Random-number-generator states of every rank, for checkpoints that resume exactly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def capture_rng_states() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), Python and NumPy generator states, as plain data and
    tensors (loadable with ``torch.load(weights_only=True)``)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": _numpy_state(),
    }


def _numpy_state() -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return name, torch.from_numpy(np.array(keys)), pos, has_gauss, cached  # a tensor: weights_only loads it


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_states` returned."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable, no tensors), indexed by rank: a collective call under
    torch.distributed, ``[value]`` without it."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_states(value: Any) -> list[Any]:
    """Every rank's ``value`` (plain data and CPU or device tensors, which come back on the CPU),
    indexed by rank: a collective call under torch.distributed."""
    # Tensors travel as lists: all_gather_object cannot unpickle tensors in some torch versions.
    return [_decode(g) for g in gather_objects(_encode(value))]


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's states, indexed by rank (a collective call under torch.distributed)."""
    return gather_states(capture_rng_states())


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v) for v in value)
    return value
