"""Triton kernel: softmax cross-entropy per row with the gradient written over the logits.

One program per row: an online-softmax pass over the vocabulary (running max and rescaled sum, fp32)
gives the log-sum-exp and the row's loss; a second pass overwrites the logits with the gradient
``(softmax - one_hot(target)) * dz/draw`` in the logits' own dtype, where ``z`` is the model's
transformed logit (scaling, soft-capping: :class:`~lit_instruct.loss.logits.LogitTransform`).
Ignored rows get loss 0 and a zero gradient. Runs on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1`` (for tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.contract import check_labels
from lit_instruct.loss.logits import IDENTITY, LogitTransform


def triton_available() -> bool:
    """Whether the ``triton`` package is installed."""
    return importlib.util.find_spec("triton") is not None


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _transformed(x, scale, softcap, SOFTCAP: tl.constexpr):
        """``z`` from raw logits, and ``dz/draw``: scaling, then ``softcap * tanh(. / softcap)``."""
        x = x * scale
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(x / softcap))  # tanh through exp: the interpreter has no tanh
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(x < 0, -t, t)
            return softcap * t, scale * (1.0 - t * t)
        return x, tl.zeros_like(x) + scale

    @triton.jit
    def _ce_grad_inplace_kernel(
        logits_ptr,
        row_stride,
        targets_ptr,
        loss_ptr,
        vocab_size,
        ignore_index,
        scale,
        softcap,
        SOFTCAP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        target = tl.load(targets_ptr + row)
        ignored = target == ignore_index
        keep = tl.where(ignored, 0.0, 1.0)
        safe_target = tl.where(ignored, 0, target)

        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_vocab = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
            z, _ = _transformed(x, scale, softcap, SOFTCAP)
            z = tl.where(in_vocab, z, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            # While every logit so far is -inf, exp(-inf - -inf) would be NaN: shift by 0 instead.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target_raw = tl.load(row_ptr + safe_target).to(tl.float32)
        target_z, _ = _transformed(target_raw, scale, softcap, SOFTCAP)
        tl.store(loss_ptr + row, (lse - target_z) * keep)

        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_vocab = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
            z, slope = _transformed(x, scale, softcap, SOFTCAP)
            grad = (tl.exp(z - lse) - tl.where(cols == safe_target, 1.0, 0.0)) * slope
            tl.store(row_ptr + cols, (grad * keep).to(logits_ptr.dtype.element_ty), mask=in_vocab)


def launch_config(vocab: int, on_cuda: bool) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: on CUDA, blocks up to 32768 columns with 8 to 32 warps (the sizes
    Liger-Kernel uses for its CE kernel), so a 128k vocabulary takes 4 loop trips per pass; the
    interpreter gets small blocks (it runs them as NumPy arrays)."""
    block = triton.next_power_of_2(vocab)
    if not on_cuda:
        return min(block, 1024), 4
    block = min(block, 32768)
    return block, 32 if block >= 16384 else 16 if block >= 4096 else 8


def ce_grad_inplace_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    block: int | None = None,
    transform: LogitTransform = IDENTITY,
    check: bool = True,
) -> torch.Tensor:
    """Per-row CE of ``transform(logits)`` (``logits``: raw ``(c, V)``) as fp32 ``(c,)``; ``logits``
    becomes the gradient w.r.t. itself. ``check=False`` skips the target bounds check (a device
    sync) for a caller that checked them already.

    Raises:
        RuntimeError: when triton is missing, or the tensors are on the CPU without
            ``TRITON_INTERPRET=1``.
        ValueError: for a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    if not triton_available():
        raise RuntimeError("the triton backend needs `pip install lit-instruct[triton]`")
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1)")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary (the gradient is written in place)")
    rows, vocab = logits.shape
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device}, logits on {logits.device}")
    if check:
        check_labels(targets, vocab, ignore_index)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return loss
    default_block, warps = launch_config(vocab, logits.is_cuda)
    softcap = transform.softcap
    # Launch on the tensors' device, not the current one (a rank's tensors may sit on cuda:1).
    on_device = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with on_device:
        _ce_grad_inplace_kernel[(rows,)](
            logits,
            logits.stride(0),
            targets.contiguous(),
            loss,
            vocab,
            ignore_index,
            float(transform.scale),
            float(softcap or 1.0),
            SOFTCAP=softcap is not None,
            BLOCK=block or default_block,
            num_warps=warps,
        )
    return loss
