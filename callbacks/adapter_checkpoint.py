"""ModelCheckpoint that also writes, next to each kept checkpoint, its PEFT adapter folder.

Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.AdapterCheckpoint
          init_args: {monitor: val/loss, mode: min, save_top_k: 2}
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_instruct.export import save_adapter


class AdapterCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``; each checkpoint it keeps also gets an adapter folder.

    ``epoch=1-step=60.ckpt`` comes with ``epoch=1-step=60-adapter/`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, written atomically, loadable with ``PeftModel.from_pretrained``),
    and loses it when the checkpoint is rotated out. So the best adapter is a folder a user can load
    without Lightning. The module needs a PEFT ``model`` attribute (``InstructLoRAModule`` has one).
    """

    @staticmethod
    def adapter_dir(checkpoint_path: str | Path) -> Path:
        """The adapter folder that goes with a checkpoint file."""
        path = Path(checkpoint_path)
        return path.with_name(path.stem + "-adapter")

    @override
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            save_adapter(trainer.lightning_module.model, self.adapter_dir(filepath))

    @override
    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            shutil.rmtree(self.adapter_dir(filepath), ignore_errors=True)
