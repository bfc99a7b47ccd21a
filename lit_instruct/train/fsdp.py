"""FSDP2 (``fully_shard``) for LoRA and QLoRA: what gets sharded, and full tensors where they are needed.

The base model is sharded per decoder layer, at the trunk (the decoder stack with its embeddings
and final norm, which :meth:`InstructLoRAModule.trunk` calls) and at the lm_head: each layer's
weights are gathered just before its forward and freed after it. LoRA adapters are sharded with
their layer and stay trainable; their gradients are reduce-scattered (averaged over ranks, as DDP
averages them). A 4-bit (NF4) base shards the same way when bitsandbytes packs it in the compute
dtype (``bnb_4bit_quant_storage``, which :func:`lit_instruct.models.load.load_base_model` sets).

A vision-language model's multimodal core (which the trunk calls for every batch, and which embeds
the text before its decoder runs) takes the decoder stack's place, but its vision tower and
projector are not sharded: the core calls them only for batches with images, and a sharded part
must be called on every rank at once (its weights are gathered by a collective). Each rank keeps
them whole, as DDP does, and their trainable weights' gradients are averaged over ranks before the
optimizer step (:func:`average_replicated_gradients`).

The lm_head is not part of the trunk's forward: the fused loss reads its weight directly. Read through
:func:`full_tensor`, a sharded weight is gathered for the loss only (its shard stays the stored copy);
the loss refuses a sharded weight outright (:func:`refuse_sharded`), so it can never compute on a
shard by mistake.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lit_instruct.distributed import full_tensor, is_sharded
from lit_instruct.models.decoder import decoder_of, parts_outside_decoder

HYBRID_DIMS = ("replicate", "shard")
"""The dimensions of a hybrid-sharding mesh (FSDP2 replicates over the first, shards over the second)."""


def sharding_mesh(mesh: Any) -> Any:
    """What ``fully_shard`` takes from a strategy's mesh: a hybrid ``(replicate, shard)`` mesh whole
    (HSDP), else its data-parallel dimension (Lightning's ``ModelParallelStrategy`` mesh)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names == HYBRID_DIMS:
        return mesh
    return mesh["data_parallel"] if names else mesh


def shard_model(base: Any, mesh: Any, reshard_after_forward: bool = True) -> None:
    """``fully_shard`` each decoder layer of ``base``, then its decoder stack (then a vision-language
    model's multimodal core, its vision tower and projector left whole), then its lm_head.

    In training the lm_head's forward never runs (the loss reads its weight, whole through
    :func:`full_tensor`); sampling runs it (its own group gathers it; a head tied to the input
    embeddings, tied again to the embedding's shard, is gathered by :func:`whole_tied_head`).
    """
    from torch.distributed.fsdp import fully_shard

    decoder = decoder_of(base)
    head = base.get_output_embeddings()
    tied = head is not None and head.weight is decoder.get_input_embeddings().weight
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    outside = [base.get_submodule(name) for name in parts_outside_decoder(base)]
    if outside:  # the multimodal core (the trunk's call; it embeds the text before the decoder runs)
        kept = {p for part in outside for p in part.parameters()}  # left whole on every rank
        fully_shard(
            base.base_model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept
        )
    else:
        fully_shard(decoder, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if tied:
        head.weight = decoder.get_input_embeddings().weight
    elif head is not None:
        fully_shard(head, mesh=mesh)


@contextmanager
def whole_tied_head(base: Any) -> Iterator[None]:
    """For the head's own forward (generation): a head tied to the sharded input embedding computes
    with the whole weight, gathered once (a collective: every rank enters) and put back after. A head
    sharded in a group of its own gathers itself in its forward, and an unsharded one needs nothing."""
    from torch.distributed.fsdp import FSDPModule

    head = base.get_output_embeddings()
    if head is None or isinstance(head, FSDPModule) or not is_sharded(head.weight):
        yield
        return
    shard = head.weight
    whole = full_tensor(shard)
    assert whole is not None
    head.weight = torch.nn.Parameter(whole.detach(), requires_grad=False)
    try:
        yield
    finally:
        head.weight = shard


def broadcast_whole(parameters: list[torch.nn.Parameter]) -> None:
    """Give every rank rank 0's values of ``parameters`` (whole tensors; a collective)."""
    import torch.distributed as dist

    with torch.no_grad():
        for p in parameters:
            dist.broadcast(p.data, src=0)


def average_replicated_gradients(parameters: list[torch.nn.Parameter], world_size: int) -> None:
    """Average the gradients of trainable weights FSDP does not shard over all ranks (a collective:
    every rank calls it with the same weights). A weight without a gradient on one rank (its part not
    called there: no image in its batch) counts as zero there; one without a gradient on every rank
    keeps none, as on one process."""
    import torch.distributed as dist

    if not parameters:
        return
    device = parameters[0].device
    had = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32, device=device)
    dist.all_reduce(had, op=dist.ReduceOp.MAX)
    used = [p for p, flag in zip(parameters, had.tolist(), strict=True) if flag]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if used:
        flat = torch.cat([p.grad.reshape(-1) for p in used])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        flat /= world_size
        for p, part in zip(used, flat.split([p.numel() for p in used]), strict=True):
            p.grad.copy_(part.view_as(p))  # type: ignore[union-attr]


def gathered_trainable_state(module: torch.nn.Module) -> dict[str, Any]:
    """The trainable weights of a sharded ``module``, whole and on the CPU, on rank 0 (empty on the
    others); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(module, options=options)


def fill_from_rank_zero(
    module: torch.nn.Module, full_state: dict[str, Any] | None, device: torch.device
) -> None:
    """After sharding: give every rank its shards of rank 0's weights (``full_state``, whole, on rank 0
    only; ``None`` elsewhere) and rank 0's buffers; a rank built on the meta device first gets the
    memory of its own shards only (``to_empty``). A collective: every rank calls it.

    Raises:
        RuntimeError: when a tensor the model keeps outside its parameters and buffers is still on the
            meta device (it would be garbage).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, full_state or {}, options=options)
    for buffer in module.buffers():  # non-persistent ones (rotary frequencies) are in no state dict
        dist.broadcast(buffer, src=0)
    for name, sub in module.named_modules():
        for attribute, value in list(vars(sub).items()):
            if not (isinstance(value, torch.Tensor) and value.is_meta):
                continue
            if attribute == "original_inv_freq" and isinstance(getattr(sub, "inv_freq", None), torch.Tensor):
                setattr(sub, attribute, sub.inv_freq.clone())  # rotary: the frequencies before any rescaling
                continue
            raise RuntimeError(f"{name}.{attribute} is still on the meta device after loading from rank 0")
