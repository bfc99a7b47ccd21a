"""Fused linear cross-entropy: loss and gradients without the full ``[tokens, vocab]`` logits.

The forward pass drops ignored rows (prompt, padding) before the projection, then walks the rest in
token chunks whose logits fit a bounded workspace. For each chunk it computes the logits, the loss
(softmax statistics in fp32 even for bf16 inputs), turns the logits into their gradient in place
(``softmax - one_hot``), and right there does the lm_head backward: ``grad_hidden = grad_logits @ W``
(and ``grad_weight += grad_logits.T @ hidden`` when the lm_head is trainable, in fp32). Backward only
scales the saved gradients by the incoming gradient, so nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_instruct.data.render import IGNORE_INDEX
from lit_instruct.loss.reference import Reduction

Backend = Literal["auto", "torch", "triton"]

WORKSPACE_BYTES = 64 * 2**20
"""Bound on one chunk's fp32 logits; the chunk has ``WORKSPACE_BYTES // (4 * V)`` rows by default."""


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that a chunk's fp32 logits take at most :data:`WORKSPACE_BYTES`."""
    return max(1, WORKSPACE_BYTES // (4 * vocab_size))


def _resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from lit_instruct.loss.triton_ce import triton_available

        if triton_available():
            return "triton"
    return "torch"


def _ce_grad_inplace_torch(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row CE of fp32 ``logits`` ``(c, V)``; ``logits`` is overwritten with ``softmax - one_hot``."""
    rows = torch.arange(len(targets), device=logits.device)
    target_logit = logits[rows, targets]  # (c,)
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    logits.sub_(lse.unsqueeze(1)).exp_()
    logits[rows, targets] -= 1.0
    return lse - target_logit


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        reduction: Reduction,
        chunk_size: int | None,
        backend: Backend,
    ) -> torch.Tensor:
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kept = (labels != ignore_index).nonzero().squeeze(1)  # (n,)
        h = hidden.index_select(0, kept)  # (n, H)
        y = labels.index_select(0, kept)  # (n,)
        n, vocab = len(kept), weight.shape[0]
        chunk = chunk_size or default_chunk_size(vocab)
        use_triton = _resolve_backend(backend, hidden.device) == "triton"
        if use_triton:
            from lit_instruct.loss.triton_ce import ce_grad_inplace_triton

        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(h) if need_hidden_grad else None  # (n, H)
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        )
        for start in range(0, n, chunk):
            hc, yc = h[start : start + chunk], y[start : start + chunk]
            logits = hc @ weight.T  # (c, V), input dtype
            if use_triton:
                loss += ce_grad_inplace_triton(logits, yc, ignore_index).sum()
                grad_logits = logits
            else:
                logits = logits.float()
                loss += _ce_grad_inplace_torch(logits, yc).sum()
                grad_logits = logits.to(hidden.dtype) if grad_h is not None else logits
            if grad_h is not None:
                torch.mm(grad_logits.to(weight.dtype), weight, out=grad_h[start : start + chunk])
            if grad_w is not None:
                grad_w.addmm_(grad_logits.T.float(), hc.float())

        scale = 1.0 / max(n, 1) if reduction == "mean" else 1.0
        ctx.scale = scale
        ctx.hidden_shape, ctx.hidden_dtype, ctx.weight_dtype = hidden.shape, hidden.dtype, weight.dtype
        ctx.save_for_backward(kept, grad_h, grad_w)
        return loss * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, grad_h, grad_w = ctx.saved_tensors
        factor = grad_out * ctx.scale
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.zeros(ctx.hidden_shape, dtype=ctx.hidden_dtype, device=grad_out.device)
            grad_hidden.index_copy_(0, kept, grad_h * factor.to(grad_h.dtype))
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_w * factor).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=..., reduction=...)``, fused.

    Args:
        hidden: ``(N, H)`` final hidden states (fp32 or bf16/fp16).
        weight: ``(V, H)`` lm_head weight; its gradient is computed (fp32-accumulated) when it
            requires one.
        labels: ``(N,)`` targets; ``ignore_index`` rows cost nothing.
        reduction: ``mean`` over counted rows (0 when there are none), or ``sum``.
        chunk_size: token rows per chunk (default: a 64 MiB fp32 logits workspace).
        backend: ``torch`` (any device), ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``auto`` (triton on CUDA when installed, else torch).

    Returns:
        The fp32 scalar loss.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H), weight (V, H), labels (N,); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return _FusedLinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, reduction, chunk_size, backend
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
        reduction: Reduction = "mean",
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden, weight, labels, reduction=reduction, chunk_size=self.chunk_size, backend=self.backend
        )
