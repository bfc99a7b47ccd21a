"""Checkpoint files that are never half-written and never run code when loaded."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_instruct.io import check_archive, named_on_failure, remove_leftovers, staging_prefix, sync_folder


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic saves and ``weights_only`` loads.

    A checkpoint is written to a temporary file next to its target, flushed to disk, and renamed
    over the target: a crash or Ctrl-C mid-write leaves the previous file (or none), never a
    truncated one. Loading checks the file's zip records against their CRCs (a bit flipped on disk
    is refused, never trained on), then uses ``torch.load(weights_only=True)``: tensors and plain
    data only, so a crafted checkpoint cannot execute code (lit-instruct's own checkpoints hold
    nothing else). ``lit-instruct fit`` uses it unless another checkpoint IO is configured; in Python:
    ``Trainer(plugins=[SafeCheckpointIO()])``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("SafeCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(path)
        temporary = path.with_name(f"{staging_prefix(path)}{os.getpid()}.tmp")
        try:
            with named_on_failure(path), open(temporary, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
            sync_folder(path.parent)
        finally:
            temporary.unlink(missing_ok=True)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError("SafeCheckpointIO loads checkpoints with weights_only=True only")
        check_archive(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)
