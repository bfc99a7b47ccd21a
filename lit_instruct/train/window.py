"""The loss over an optimizer step's window of micro-batches, on every rank.

Each micro-batch contributes its objective's *summed* loss and the count it is normalized by
(response tokens, pairs, answers); at the optimizer step the window's sums and counts are
all-reduced and the gradient is rescaled so that it is that of ``sum(loss) / count`` over the whole
window: every token (pair, answer) weighs the same, whatever the accumulation, rank or batch it is in
(a mean of per-batch means would weigh a token of a short answer more than one of a long one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from lit_instruct.distributed import local_tensor


@dataclass(frozen=True)
class WindowTotals:
    """What one optimizer step (or one validation) saw, over all ranks."""

    loss_sum: float
    count: int
    tokens: int = 0
    answer_tokens: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """The mean loss over the counted units (0 for a window without any)."""
        return self.loss_sum / max(self.count, 1)

    def metrics(self) -> dict[str, float]:
        """Each per-unit metric averaged over every counted unit."""
        return {name: value / max(self.count, 1) for name, value in self.metric_sums.items()}


def gradient_factor(count: int, accumulate_grad_batches: int, world_size: int) -> float:
    """What turns the gradient Lightning and DDP leave into that of ``sum(loss) / count``.

    Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and DDP averages the
    gradients of ``world_size`` ranks: both are undone, and the all-reduced count divides instead.
    """
    return accumulate_grad_batches * world_size / max(count, 1)


def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing gradient in place (one foreach kernel per device and dtype; sharded
    gradients shard by shard)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


class StepWindow:
    """Accumulates one rank's micro-batches until the optimizer step, then totals them over ranks.

    The sums (loss, then each metric) stay a tensor on the loss's device until :meth:`close`, so
    adding a micro-batch never waits for the device.
    """

    def __init__(self, metric_names: Iterable[str] = ()) -> None:
        self.names = list(metric_names)
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: torch.Tensor | None = None  # in the loss's fp32, as summed before the objectives
        self._sums: torch.Tensor | None = None  # each metric's sum, fp64
        self._counts = [0, 0, 0]  # count, tokens, answer tokens

    def add(
        self,
        loss_sum: torch.Tensor,
        count: int,
        tokens: int = 0,
        answer_tokens: int = 0,
        metric_sums: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch: its summed loss (detached here), its count, its tokens and labelled
        tokens, and its metrics' sums (in ``names``' order)."""
        loss = loss_sum.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        if self.names:
            sums = metric_sums if metric_sums is not None else loss.new_zeros(len(self.names))
            sums = sums.detach().double().to(loss.device)
            self._sums = sums if self._sums is None else self._sums + sums
        self._counts = [a + b for a, b in zip(self._counts, (count, tokens, answer_tokens), strict=True)]

    def close(
        self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device
    ) -> WindowTotals:
        """The window's totals over all ranks (``all_reduce_sum`` is a collective: every rank calls
        it, with or without micro-batches); the window starts empty again."""
        packed = torch.zeros(4 + len(self.names), dtype=torch.float64, device=device)
        packed[:3] = torch.tensor(self._counts, dtype=torch.float64)
        if self._loss_sum is not None:
            packed[3] = self._loss_sum.to(device)
        if self._sums is not None:
            packed[4:] = self._sums.to(device)
        values = all_reduce_sum(packed).tolist()
        self._reset()
        metrics = dict(zip(self.names, values[4:], strict=True))
        return WindowTotals(values[3], round(values[0]), round(values[1]), round(values[2]), metrics)
