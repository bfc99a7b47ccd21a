"""Tensors and ranks under DDP and FSDP2: a shard, its whole, and this process's rank before any
process group exists (torch only: the loss reads these)."""

from __future__ import annotations

import os

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a tensor spread over ranks)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a view: in-place changes reach it), else ``tensor``."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def full_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole of a sharded tensor (gathered from every rank; differentiable), else ``tensor``."""
    if tensor is None or not is_sharded(tensor):
        return tensor
    if not tensor.requires_grad:
        with torch.no_grad():
            return tensor.full_tensor()  # type: ignore[attr-defined]
    return tensor.full_tensor()  # type: ignore[attr-defined]


def refuse_sharded(name: str, tensor: torch.Tensor | None) -> None:
    """Raise if ``tensor`` is a shard: a loss over part of the vocabulary would be silently wrong."""
    if tensor is not None and is_sharded(tensor):
        raise TypeError(
            f"the {name} is sharded (a DTensor of local shape {tuple(tensor.to_local().shape)}): the loss "  # type: ignore[attr-defined]
            "needs the whole of it; gather it with lit_instruct.distributed.full_tensor first"
        )


def launched_rank() -> int:
    """This process's rank as its launcher set it (Lightning's and torchrun's ``LOCAL_RANK`` /
    ``RANK``, srun's ``SLURM_PROCID`` for a job of several tasks), before any process group exists;
    0 when not launched as a rank."""
    slurm = int(os.environ.get("SLURM_PROCID", "0")) if int(os.environ.get("SLURM_NTASKS", "1")) > 1 else 0
    return max(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), slurm)
