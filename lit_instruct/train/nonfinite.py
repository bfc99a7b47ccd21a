"""Skip optimizer steps whose loss or gradients are not finite, on every rank at once.

:class:`~lit_instruct.train.module.InstructLoRAModule` installs it itself (a plain ``Trainer`` from
Python skips them too); a config sets its own to change its settings. Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.SkipNonFiniteSteps
          init_args: {max_consecutive: 5}
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_instruct.distributed import local_tensor
from lit_instruct.io import checkpoint_dir


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class SkipNonFiniteSteps(L.Callback):
    """Discard an optimizer step whose window has a NaN/Inf loss or gradient.

    The check runs once per optimizer step, at the step boundary: after the whole gradient-
    accumulation window and after DDP's gradient all-reduce, before clipping. The verdict is
    all-reduced, so every rank skips together. A skipped step leaves the weights, the optimizer state
    and the learning-rate schedule exactly as they were (gradients are dropped, so the optimizer and
    clipping see none, and the scheduler is rewound); ``trainer.global_step`` still counts it.

    Logged every batch: ``train/skipped_steps`` (total) and ``train/consecutive_skipped_steps``. Both
    counters are stored in checkpoints. After ``max_consecutive`` skips in a row the run saves a
    checkpoint (holding the last finite weights) and stops with :class:`NonFiniteTrainingError`.

    Args:
        max_consecutive: consecutive skipped steps that stop the run (``>= 1``).
        check_grads: also check every trainable gradient (one fused max-abs reduction per step);
            otherwise only the loss.
    """

    def __init__(self, max_consecutive: int = 10, check_grads: bool = True) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.check_grads = check_grads
        self.skipped = 0
        self.consecutive = 0
        self._window_loss_finite: torch.Tensor | None = None
        self._rewind: list[tuple[Any, dict[str, Any], list[float]]] | None = None

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        finite = torch.isfinite(loss.detach()).all()
        previous = self._window_loss_finite
        self._window_loss_finite = finite if previous is None else previous & finite

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = torch.zeros((), device=pl_module.device)
        if self._window_loss_finite is not None:
            bad += (~self._window_loss_finite).float().to(bad.device)
        if self.check_grads and params:
            grads = [local_tensor(p.grad) for p in params]  # this rank's shards: the verdict is summed
            max_abs = torch.stack(torch._foreach_norm(grads, float("inf")))
            bad += (~torch.isfinite(max_abs).all()).float().to(bad.device)
        self._window_loss_finite = None
        bad = trainer.strategy.reduce(bad, reduce_op="sum")  # every rank reaches the same verdict
        if not bad.item():
            self.consecutive = 0
            return
        for p in params:
            p.grad = None  # the optimizer and gradient clipping skip parameters without a gradient
        self._rewind = [
            (s, s.state_dict(), [g["lr"] for g in s.optimizer.param_groups])
            for s in (config.scheduler for config in trainer.lr_scheduler_configs)
        ]
        self.skipped += 1
        self.consecutive += 1
        rank_zero_warn(
            f"step {trainer.global_step}: non-finite loss or gradient, optimizer step skipped "
            f"({self.consecutive} in a row, {self.skipped} in total)"
        )

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rewind is not None:  # the loop stepped the schedulers after the skipped step: undo it
            for scheduler, state, lrs in self._rewind:
                scheduler.load_state_dict(state)
                for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
                    group["lr"] = lr
            self._rewind = None
        pl_module.log("train/skipped_steps", float(self.skipped), prog_bar=True, batch_size=1)
        pl_module.log("train/consecutive_skipped_steps", float(self.consecutive), batch_size=1)
        if self.consecutive >= self.max_consecutive:
            self._abort(trainer)

    def _abort(self, trainer: L.Trainer) -> None:
        path = checkpoint_dir(trainer) / f"nonfinite-stop-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)  # collective under DDP: every rank reaches this together
        raise NonFiniteTrainingError(
            f"{self.consecutive} optimizer steps in a row had a non-finite loss or gradient (up to step "
            f"{trainer.global_step}); stopped. The last finite weights are in {path}. Try a lower "
            "learning rate, gradient clipping (trainer.gradient_clip_val), float32 instead of "
            "float16/bfloat16, or check the data of these batches (empty or corrupt samples)."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = state_dict["skipped"]
        self.consecutive = state_dict["consecutive"]
