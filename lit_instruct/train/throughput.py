"""``train/tokens_per_s``: real tokens of each micro-batch over its wall time.

Installed by :class:`~lit_instruct.train.module.InstructLoRAModule` itself (``configure_callbacks``).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lit_instruct.batch import num_tokens


class TokensPerSecond(L.Callback):
    """Logs ``train/tokens_per_s`` (progress bar too) after every micro-batch: its non-padding
    tokens over the time from batch start to batch end (forward, backward and, on a window's last
    micro-batch, the optimizer step), the device synchronized first so the time is the device's."""

    def __init__(self) -> None:
        self._started = 0.0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        pl_module.log("train/tokens_per_s", num_tokens(batch) / elapsed, prog_bar=True, batch_size=1)
