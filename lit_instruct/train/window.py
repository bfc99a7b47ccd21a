"""Token-weighted loss over an optimizer step's window of micro-batches, on every rank.

Each micro-batch contributes the *sum* of its response-token losses; at the optimizer step the window's
sums and counts are all-reduced and the gradient is rescaled so that it is that of ``sum(CE) / count``
over the whole window: every response token weighs the same, whatever the accumulation, rank or batch
it is in (a mean of per-batch means would weigh a token of a short answer more than one of a long one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lit_instruct.distributed import local_tensor


@dataclass(frozen=True)
class WindowTotals:
    """What one optimizer step saw, over all ranks."""

    loss_sum: float
    response_tokens: int
    tokens: int

    @property
    def loss(self) -> float:
        """The token-weighted mean loss (0 for a window without response tokens)."""
        return self.loss_sum / max(self.response_tokens, 1)


def gradient_factor(response_tokens: int, accumulate_grad_batches: int, world_size: int) -> float:
    """What turns the gradient Lightning and DDP leave into that of ``sum(CE) / response_tokens``.

    Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and DDP averages the
    gradients of ``world_size`` ranks: both are undone, and the all-reduced count divides instead.
    """
    return accumulate_grad_batches * world_size / max(response_tokens, 1)


def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing gradient in place (one foreach kernel per device and dtype; sharded
    gradients shard by shard)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


class TokenWindow:
    """Accumulates one rank's micro-batches until the optimizer step, then totals them over ranks.

    The loss sum stays a tensor on the loss's device until :meth:`close`, so adding a micro-batch
    never waits for the device.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._response_tokens = 0
        self._tokens = 0

    def add(self, loss_sum: torch.Tensor, response_tokens: int, tokens: int) -> None:
        """One micro-batch: its summed loss (detached here), response-token and token counts."""
        loss_sum = loss_sum.detach().float()
        self._loss_sum = loss_sum if self._loss_sum is None else self._loss_sum + loss_sum
        self._response_tokens += response_tokens
        self._tokens += tokens

    def close(
        self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device
    ) -> WindowTotals:
        """The window's totals over all ranks (``all_reduce_sum`` is a collective: every rank calls
        it, with or without micro-batches); the window starts empty again."""
        packed = torch.tensor([0.0, self._response_tokens, self._tokens], dtype=torch.float64, device=device)
        if self._loss_sum is not None:
            packed[0] = self._loss_sum.to(device)
        loss_sum, response_tokens, tokens = all_reduce_sum(packed).tolist()
        self._reset()
        return WindowTotals(loss_sum, round(response_tokens), round(tokens))
