"""Every rank's random-number-generator states in checkpoints, put back when a run resumes.

Installed by :class:`~lit_instruct.train.module.InstructLoRAModule` itself (``configure_callbacks``): LoRA
dropout draws from them, so a resumed run draws the same masks as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_instruct.rng import gather_rng_states, restore_rng_states


class RestoreRNGStates(L.Callback):
    """Writes ``checkpoint["rng_states"]`` (a list indexed by rank: torch CPU and CUDA, Python,
    NumPy; plain data and tensors, ``weights_only``-loadable) and restores this rank's entry right
    before the first resumed step."""

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] | None = None

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            checkpoint["rng_states"] = gather_rng_states()  # collective: every rank dumps checkpoints

    @override
    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._to_restore = checkpoint.get("rng_states")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        states, self._to_restore = self._to_restore, None
        if states is None:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(f"the checkpoint has RNG states of {len(states)} ranks, not {trainer.world_size}")
            return
        restore_rng_states(states[trainer.global_rank])
