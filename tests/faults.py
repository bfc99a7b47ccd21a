"""A module that fails on purpose and a recorder of the training state, for the non-finite-step tests
(also imported by ``ddp_fit.py``)."""

from __future__ import annotations

import copy

import lightning as L
import torch

from lit_instruct.module import InstructLoRAModule


class FaultyModule(InstructLoRAModule):
    """Multiplies the loss by NaN, or puts an Inf into one LoRA gradient, at chosen batch indices
    (on every rank, or on ``fault_rank`` only)."""

    def __init__(
        self,
        *args,
        nan_loss_at: tuple[int, ...] = (),
        inf_grad_at: tuple[int, ...] = (),
        fault_rank: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.nan_loss_at, self.inf_grad_at, self.fault_rank = set(nan_loss_at), set(inf_grad_at), fault_rank
        self._batch_idx = -1

    def _faulty_here(self, batch_indices: set[int]) -> bool:
        rank_ok = self.fault_rank is None or self.global_rank == self.fault_rank
        return rank_ok and self._batch_idx in batch_indices

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._batch_idx = batch_idx
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self._faulty_here(self.nan_loss_at) else loss

    def on_after_backward(self) -> None:
        if self._faulty_here(self.inf_grad_at):
            next(p for p in self.parameters() if p.grad is not None).grad[0, 0] = float("inf")


class Recorder(L.Callback):
    """After every training batch: the LoRA weights, the optimizer state and the learning rate
    (``states``), and the logged ``train/loss`` (``losses``)."""

    def __init__(self) -> None:
        self.states: list[tuple[dict, dict, float]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        weights = {k: v.clone() for k, v in pl_module.trainable_state_dict().items()}
        self.states.append((weights, copy.deepcopy(optimizer.state_dict()), optimizer.param_groups[0]["lr"]))
        self.losses.append(float(trainer.callback_metrics.get("train/loss", float("nan"))))
