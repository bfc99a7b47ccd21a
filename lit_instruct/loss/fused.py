"""Fused linear cross-entropy: loss and gradients without the full ``[tokens, vocab]`` logits.

The forward pass drops ignored rows (prompt, padding) before the projection, then walks the rest in
token chunks whose logits fit a bounded workspace. For each chunk it computes the logits, the loss
(softmax statistics in fp32 even for bf16 inputs), turns the logits into their gradient in place
(``softmax - one_hot``), and right there does the lm_head backward: ``grad_hidden = grad_logits @ W``
(and ``grad_weight += grad_logits.T @ hidden`` when the lm_head is trainable, in fp32). Backward only
scales the saved gradients by the incoming gradient, so nothing is recomputed.

The GEMMs run in one compute dtype: autocast's when autocast is on for the tensors' device (what the
reference loss gets under ``precision: bf16-mixed``), else the promotion of the hidden and weight
dtypes. Softmax statistics and the lm_head gradients accumulate in fp32 whatever it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_instruct.distributed import refuse_sharded
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.contract import Reduction, check_labels
from lit_instruct.loss.logits import IDENTITY, LogitTransform

Backend = Literal["auto", "torch", "triton"]

WORKSPACE_BYTES = 512 * 2**20
"""Bound on one chunk's fp32 logits; the chunk has ``WORKSPACE_BYTES // (4 * V)`` rows by default."""


def default_chunk_size(vocab_size: int, buffers: int = 1) -> int:
    """Rows per chunk so that a chunk's fp32 logits (times ``buffers``: soft-capping keeps a second
    chunk-sized buffer) take at most :data:`WORKSPACE_BYTES`.

    Rounded down to a multiple of 64: GEMMs with ragged sizes run markedly slower (on CPU, 523 rows
    ran at 0.7x the speed of 512).
    """
    rows = WORKSPACE_BYTES // (4 * vocab_size * buffers)
    return max(1, rows // 64 * 64 or rows)


def _resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from lit_instruct.loss.triton_ce import triton_available

        if triton_available():
            return "triton"
    return "torch"


@dataclass
class _ChunkGrads:
    """Where a chunk writes its gradients: its rows of ``grad_hidden``, and the (fp32) sums of the
    lm_head weight and bias gradients; ``None`` for what is not needed."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def _chunk_torch(
    hc: torch.Tensor,
    yc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    buffers: tuple[torch.Tensor, torch.Tensor | None],
    grads: _ChunkGrads,
) -> torch.Tensor:
    """One chunk in PyTorch; returns its loss sum and writes / accumulates into ``grads``.

    The chunk's logits are laid out vocabulary-major, ``(V, c)``: both matmuls (``W @ h.T`` and
    ``W.T @ grad``) then run as long, cache-friendly GEMMs (about 1.2x faster on CPU than row-major
    at c = 512), and the softmax takes four column passes with no chunk-sized temporary (five when
    the lm_head trains or the weights are not fp32). With soft-capping, ``buffers[1]`` keeps
    ``1 - tanh^2`` for the chain rule. The logit scale is folded into the gradients at the end.
    """
    vocab, rows = weight.shape[0], len(hc)
    hc, yc = _pad_rows(hc, yc, buffers[0].numel() // vocab)
    c = len(hc)
    logits = buffers[0][: vocab * c].view(vocab, c)  # (V, c) fp32; hc, weight, bias: the compute dtype
    column_bias = bias[:, None] if bias is not None else None
    if weight.dtype == logits.dtype:
        if column_bias is None:
            torch.mm(weight, hc.T, out=logits)
        else:
            torch.addmm(column_bias, weight, hc.T, out=logits)
    else:
        logits.copy_(weight @ hc.T if column_bias is None else torch.addmm(column_bias, weight, hc.T))
    scale, cap = transform.scale, transform.softcap
    tanh_slope = None
    if cap is not None:
        logits.mul_(scale / cap).tanh_()
        tanh_slope = buffers[1][: vocab * c].view(vocab, c)  # type: ignore[index]  # allocated with the cap
        torch.mul(logits, logits, out=tanh_slope).neg_().add_(1.0)  # d tanh = 1 - tanh^2
        logits.mul_(cap)
    elif scale != 1.0:
        logits.mul_(scale)
    cols = torch.arange(c, device=hc.device)
    logits.sub_(logits.amax(dim=0, keepdim=True))
    shifted_target = logits[yc, cols]  # (c,)
    total = logits.exp_().sum(dim=0)  # (c,): logits now holds exp(z - max)
    loss = (total.log() - shifted_target)[:rows].sum()
    inverse = total.reciprocal()
    grad_hc = grads.hidden
    if grad_hc is not None and weight.dtype == torch.float32 and tanh_slope is None:
        # (softmax - one_hot) @ W = (exp @ W) / total - W[y]: normalizing the small (H, c) product
        # instead of the (V, c) chunk saves a full pass over the logits. (In fp32 only: in bf16 the
        # subtraction would cancel catastrophically for confident predictions.)
        product = weight.T @ logits  # (H, c)
        grad_hc.copy_(product.mul_(inverse).sub_(weight[yc].T).T[:rows])
        if scale != 1.0:
            grad_hc.mul_(scale)
        grad_hc = None  # done
    if grad_hc is None and grads.weight is None and grads.bias is None:
        return loss
    logits.mul_(inverse)  # softmax
    logits[yc, cols] -= 1.0  # softmax - one_hot: the gradient of the summed loss w.r.t. z
    if tanh_slope is not None:
        logits.mul_(tanh_slope)  # w.r.t. scale * raw
    if grad_hc is not None:
        grad_hc.copy_((weight.T @ logits.to(weight.dtype)).T[:rows])  # (rows, H)
        if scale != 1.0:
            grad_hc.mul_(scale)
    if grads.weight is not None:
        _accumulate_fp32(grads.weight, logits, hc, alpha=scale)  # (V, H); padding rows of hc are 0
    if grads.bias is not None:
        grads.bias.add_(logits[:, :rows].sum(dim=1), alpha=scale)
    return loss


ROW_MULTIPLE = 64
"""A chunk's rows are padded up to a multiple of this (zero hidden states, excluded from the loss
and the gradients): on CPU a ragged GEMM width runs markedly slower (494 columns of
``W @ h.T`` at ~105 GFLOP/s where 512 run at ~140 on the 2-core test machine)."""


def _pad_rows(hc: torch.Tensor, yc: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hc``/``yc`` with zero rows / label-0 rows appended up to a multiple of :data:`ROW_MULTIPLE`,
    when that fits in ``room`` rows of the workspace (as is, otherwise)."""
    pad = -len(hc) % ROW_MULTIPLE
    if not pad or len(hc) < ROW_MULTIPLE or len(hc) + pad > room:
        return hc, yc
    return torch.cat([hc, hc.new_zeros(pad, hc.shape[1])]), torch.cat([yc, yc.new_zeros(pad)])


def _accumulate_fp32(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """``total += alpha * a @ b`` with ``total`` fp32: a low-precision GEMM writing fp32 where the
    platform has one (CUDA ``out_dtype``), else fp32 operands."""
    if a.dtype == b.dtype == total.dtype:
        total.addmm_(a, b, alpha=alpha)
    elif a.dtype == b.dtype and a.is_cuda:
        total.add_(torch.mm(a, b, out_dtype=torch.float32), alpha=alpha)
    else:
        total.addmm_(a.float(), b.float(), alpha=alpha)


def _chunk_triton(
    hc: torch.Tensor,
    yc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    buffer: torch.Tensor,
    grads: _ChunkGrads,
    ignore_index: int,
) -> torch.Tensor:
    """One chunk with the Triton kernel: row-major ``(c, V)`` logits in the compute dtype, turned in
    place into the gradient w.r.t. the raw logits (transform's chain rule included; the kernel keeps
    its softmax statistics in fp32)."""
    from lit_instruct.loss.triton_ce import ce_grad_inplace_triton

    vocab, c = weight.shape[0], len(hc)
    logits = buffer[: c * vocab].view(c, vocab)  # (c, V)
    if bias is None:
        torch.mm(hc, weight.T, out=logits)
    else:
        torch.addmm(bias, hc, weight.T, out=logits)
    loss = ce_grad_inplace_triton(logits, yc, ignore_index, transform=transform, check=False).sum()
    if grads.hidden is not None:
        torch.mm(logits, weight, out=grads.hidden)
    if grads.weight is not None:
        _accumulate_fp32(grads.weight, logits.T, hc)
    if grads.bias is not None:
        grads.bias.add_(logits.sum(dim=0, dtype=torch.float32))
    return loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        transform: LogitTransform,
        ignore_index: int,
        reduction: Reduction,
        chunk_size: int | None,
        backend: Backend,
        grad_enabled: bool,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        # Under no_grad (evaluation) no gradient is computed at all.
        need = [grad_enabled and ctx.needs_input_grad[i] for i in range(3)]
        kept = (labels != ignore_index).nonzero().squeeze(1)  # (n,)
        y = labels.index_select(0, kept)  # (n,)
        n, vocab = len(kept), weight.shape[0]
        check_labels(y, vocab, ignore_index)  # the kernel would read out of bounds, torch index from the end
        weight_dtype, bias_dtype = weight.dtype, bias.dtype if bias is not None else None
        h = hidden.index_select(0, kept).to(compute_dtype)  # (n, H)
        weight, bias = weight.to(compute_dtype), bias.to(compute_dtype) if bias is not None else None
        use_triton = _resolve_backend(backend, hidden.device) == "triton"
        keeps_slope = transform.softcap is not None and not use_triton  # the kernel needs no buffer for it
        chunk = chunk_size or default_chunk_size(vocab, buffers=2 if keeps_slope else 1)
        size, device = min(chunk, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE) * vocab, hidden.device
        buffer = torch.empty(size, dtype=compute_dtype if use_triton else torch.float32, device=device)
        slope = torch.empty(size, dtype=torch.float32, device=device) if keeps_slope else None
        loss = torch.zeros((), dtype=torch.float32, device=device)
        grad_h = torch.empty_like(h) if need[0] else None  # (n, H)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need[1] else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=device) if need[2] else None
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            grads = _ChunkGrads(grad_h[rows] if grad_h is not None else None, grad_w, grad_b)
            if use_triton:
                loss += _chunk_triton(h[rows], y[rows], weight, bias, transform, buffer, grads, ignore_index)
            else:
                loss += _chunk_torch(h[rows], y[rows], weight, bias, transform, (buffer, slope), grads)

        scale = 1.0 / max(n, 1) if reduction == "mean" else 1.0
        ctx.scale = scale
        ctx.hidden_shape, ctx.hidden_dtype = hidden.shape, hidden.dtype
        ctx.weight_dtype, ctx.bias_dtype = weight_dtype, bias_dtype
        ctx.save_for_backward(kept, grad_h, grad_w, grad_b)
        return loss * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, grad_h, grad_w, grad_b = ctx.saved_tensors
        factor = grad_out * ctx.scale
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.zeros(ctx.hidden_shape, dtype=ctx.hidden_dtype, device=grad_out.device)
            grad_hidden.index_copy_(0, kept, (grad_h * factor.to(grad_h.dtype)).to(ctx.hidden_dtype))
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_w * factor).to(ctx.weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = (grad_b * factor).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(transform(hidden @ weight.T + bias), labels, ...)``, fused.

    Args:
        hidden: ``(N, H)`` final hidden states (fp32 or bf16/fp16).
        weight: ``(V, H)`` lm_head weight; its gradient is computed (fp32-accumulated) when it
            requires one.
        labels: ``(N,)`` targets; ``ignore_index`` rows cost nothing.
        bias: ``(V,)`` lm_head bias, if any (its gradient too, when it requires one).
        transform: the model's logit scaling and soft-capping, chain rule included.
        ignore_index: the label of rows that are not predicted.
        reduction: ``mean`` over counted rows (0 when there are none), or ``sum``.
        chunk_size: token rows per chunk (default: a 512 MiB fp32 logits workspace).
        backend: ``torch`` (any device), ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``auto`` (triton on CUDA when installed, else torch).

    The GEMMs run in autocast's dtype when autocast is on for the tensors' device, else in the
    promotion of ``hidden`` and ``weight``'s dtypes (a bf16 hidden with an fp32 weight: fp32);
    softmax statistics and lm_head gradient sums are fp32, and each gradient comes back in its
    input's dtype.

    Returns:
        The fp32 scalar loss.

    Raises:
        ValueError: for bad shapes, or a label outside ``[0, V)`` that is not ``ignore_index``.
        TypeError: for a sharded (FSDP) weight or bias.
    """
    refuse_sharded("lm_head weight", weight)
    refuse_sharded("lm_head bias", bias)
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H), weight (V, H), labels (N,); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"expected bias (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):  # the casts are explicit, inside
        return _FusedLinearCrossEntropy.apply(
            hidden,
            weight,
            bias,
            labels,
            transform,
            ignore_index,
            reduction,
            chunk_size,
            backend,
            torch.is_grad_enabled(),
            compute_dtype,
        )


@dataclass(frozen=True)
class FusedLinearCrossEntropy:
    """The fused loss with its options bound; what a strategy installs as ``module.loss_fn``."""

    chunk_size: int | None = None
    backend: Backend = "auto"

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        transform: LogitTransform = IDENTITY,
        reduction: Reduction = "mean",
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias=bias,
            transform=transform,
            reduction=reduction,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
