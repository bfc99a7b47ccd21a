"""Held-out sums of one validation: the objective's loss, its count and metric sums, per source
(the loaders of a multi-source validation carry their source's name) and over all of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lit_instruct.train.window import WindowTotals


class ValidationSums:
    """Rows of ``(loss sum, count, metric sums...)`` in fp64 on the device, one per source
    (``None``: batches without a source), totalled over ranks by :meth:`close`."""

    def __init__(self, metric_names: Iterable[str] = ()) -> None:
        self.names = list(metric_names)
        self.rows: dict[str | None, torch.Tensor] = {}

    def reset(self) -> None:
        self.rows = {}

    def add(
        self, source: str | None, loss_sum: torch.Tensor, count: int, metric_sums: torch.Tensor | None = None
    ) -> None:
        """One batch's sums (``source``: its loader's source name, or ``None``)."""
        loss = loss_sum.detach().double().reshape(1)
        extra = metric_sums if metric_sums is not None else loss.new_zeros(len(self.names))
        row = torch.cat([loss, loss.new_tensor([float(count)]), extra.detach().double().to(loss.device)])
        self.rows[source] = row if source not in self.rows else self.rows[source] + row

    def close(
        self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], device: torch.device
    ) -> tuple[WindowTotals, dict[str, WindowTotals]]:
        """The totals over all ranks, overall and per named source (one collective: every rank
        calls it, and every rank saw every source's loader)."""
        names = sorted(name for name in self.rows if name is not None)
        width = 2 + len(self.names)
        overall = torch.zeros(width, dtype=torch.float64, device=device)
        for row in self.rows.values():
            overall += row.to(device)
        stacked = torch.stack([overall, *(self.rows[name].to(device) for name in names)])
        reduced = all_reduce_sum(stacked).tolist()
        self.reset()

        def totals(values: list[float]) -> WindowTotals:
            return WindowTotals(
                values[0], round(values[1]), metric_sums=dict(zip(self.names, values[2:], strict=True))
            )

        return totals(reduced[0]), {
            name: totals(values) for name, values in zip(names, reduced[1:], strict=True)
        }
