"""ModelCheckpoint that also keeps, next to each checkpoint it keeps, its PEFT adapter folder.

Example::

    trainer:
      callbacks:
        - class_path: lit_instruct.callbacks.AdapterCheckpoint
          init_args: {monitor: val/loss, mode: min, save_top_k: 2}
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_instruct.adapter_folder import ADAPTER_WEIGHTS, save_adapter
from lit_instruct.io import written_by_us

SAVING_HOOKS = frozenset(
    {"on_train_batch_end", "on_train_epoch_end", "on_validation_end", "on_exception", "on_train_end"}
)
"""The public hooks in which ``ModelCheckpoint`` may save or remove checkpoints (a test checks that
it overrides no other)."""


class AdapterCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``; each checkpoint it keeps also gets an adapter folder.

    ``epoch=1-step=60.ckpt`` comes with ``epoch=1-step=60-adapter/`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, written atomically, loadable with ``PeftModel.from_pretrained``),
    and loses it when the checkpoint is rotated out. So the best adapter is a folder a user can load
    without Lightning. The module needs a PEFT ``model`` attribute (``InstructLoRAModule`` has one).

    Only public API: after each hook in which ``ModelCheckpoint`` saves, the adapter folders are
    brought in line with the checkpoint files it keeps (``best_k_models``, ``best_model_path``,
    ``last_model_path``): a new or rewritten file gets the adapter of the weights it was just written
    from, a removed one loses its folder.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adapters: dict[str, tuple[int, int]] = {}  # checkpoint -> its (inode, mtime) when adapted
        self._before_fit: dict[str, tuple[int, int]] = {}  # kept files as training started

    @staticmethod
    def adapter_dir(checkpoint_path: str | Path) -> Path:
        """The adapter folder that goes with a checkpoint file."""
        path = Path(checkpoint_path)
        return path.with_name(path.stem + "-adapter")

    def _kept(self) -> set[str]:
        return {str(p) for p in (*self.best_k_models, self.best_model_path, self.last_model_path) if p}

    @override
    def state_dict(self) -> dict[str, Any]:
        """``ModelCheckpoint``'s state, and which checkpoint files have their adapter written: a resumed
        run must not write them again from its own (later) weights."""
        return {**super().state_dict(), "adapters": {p: list(stamp) for p, stamp in self._adapters.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state; of the adapters it names, those in this callback's own folder only (a
        checkpoint from elsewhere names no folder to remove)."""
        super().load_state_dict(state_dict)
        here = Path(self.dirpath).resolve() if self.dirpath else None
        self._adapters = {
            p: (int(s[0]), int(s[1]))
            for p, s in state_dict.get("adapters", {}).items()
            if here is not None and Path(p).parent.resolve() == here
        }

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._before_fit = {p: s for p in self._kept() if (s := _stamp(p)) is not None}

    def sync_adapters(self, trainer: L.Trainer) -> None:
        """Write the adapter of each kept checkpoint file that is new or rewritten since the last
        call, and remove the adapters of checkpoint files that are gone (rank 0).

        A file this fit wrote gets the adapter of the module's weights (the hook follows its save);
        a file from before this fit (a resumed run's) is never given the weights of now: its folder
        is kept when written after the file, else written from the file's own state."""
        if not trainer.is_global_zero:
            return
        for path in [p for p in self._adapters if not os.path.exists(p)]:
            folder = self.adapter_dir(path)
            if folder.is_dir() and _all_ours(folder):
                shutil.rmtree(folder, ignore_errors=True)
            del self._adapters[path]
        for path in self._kept():
            stamp = _stamp(path)
            if stamp is None:
                continue
            folder = self.adapter_dir(path)
            if self._adapters.get(path) == stamp and (folder / ADAPTER_WEIGHTS).is_file():
                continue
            if self._before_fit.get(path) != stamp:  # written by this fit, from the weights of now
                self._write(trainer, folder, None)
            elif not _written_after(folder, stamp[1]):
                state = trainer.strategy.checkpoint_io.load_checkpoint(path)["state_dict"]
                self._write(trainer, folder, {k.removeprefix("model."): v for k, v in state.items()})
            self._adapters[path] = stamp

    @staticmethod
    def _write(trainer: L.Trainer, folder: Path, state: dict[str, Any] | None) -> None:
        module = trainer.lightning_module
        # InstructLoRAModule's writer adds the template, a grown tokenizer, a residual-init conversion
        write = getattr(module, "write_adapter", None)
        if callable(write):
            write(folder, state, setting="AdapterCheckpoint")
        else:
            save_adapter(module.model, folder, state, setting="AdapterCheckpoint")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.sync_adapters(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.sync_adapters(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self.sync_adapters(trainer)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.sync_adapters(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.sync_adapters(trainer)


def _written_after(folder: Path, mtime_ns: int) -> bool:
    """Whether ``folder`` holds a whole adapter written after ``mtime_ns`` (its checkpoint's time)."""
    weights = folder / ADAPTER_WEIGHTS  # folders appear whole (atomic_directory): no half-written one
    return weights.is_file() and weights.stat().st_mtime_ns >= mtime_ns


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's (inode, mtime): changed when it is rewritten; ``None`` when it is no file."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_mtime_ns) if os.path.isfile(path) else None


def _all_ours(folder: Path) -> bool:
    entries = [entry.name for entry in folder.iterdir()]
    return set(entries) <= written_by_us(folder, entries)
