"""Where a run writes, and writes that never leave a half-written result: a folder or a file appears
whole, or not at all; the adapter folder training writes (weights, config, chat template)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def atomic_directory(target: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target``, on failure it is removed.
    ``replace=False`` (a content-addressed cache, filled by several processes or nodes at once):
    a ``target`` that another process put in place first is kept, and the staging folder dropped."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        _as_umask_allows(staging)
        if not replace:
            try:
                staging.rename(target)
            except OSError:  # already there (ENOTEMPTY / EEXIST): the same contents by its key
                if not target.is_dir():
                    raise
                shutil.rmtree(staging, ignore_errors=True)
            return
        if target.exists():
            retired = target.with_name(f".{target.name}-old")
            shutil.rmtree(retired, ignore_errors=True)
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _as_umask_allows(folder: Path) -> None:
    """Modes as a plain write would give them (0644 / 0755 under umask 022): staging folders and
    temporary files are created private (0700 / 0600), and safetensors writes 0600, so a serving
    process under another user could not read an adapter."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod((0o777 if executable else 0o666) & ~mask)


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: never a half-written page."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def log_dir(trainer: Any) -> Path:
    """A Lightning Trainer's log directory, else its root directory.

    Under DDP ``trainer.log_dir`` is broadcast from rank 0, a collective: call this on every rank,
    before any ``is_global_zero`` branch, or the run hangs.
    """
    return Path(trainer.log_dir or trainer.default_root_dir)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
"""The chat template an adapter was trained with, beside it (the name ``transformers`` uses)."""


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise if any tensor holds NaN or Inf, naming the first such tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: tensor {name!r} contains NaN or Inf; refusing to write it")


def save_adapter(
    peft_model: Any,
    target: str | Path,
    state_dict: dict[str, Any] | None = None,
    chat_template: str | None = None,
    tokenizer: Any = None,
    convert: Callable[[Path], None] | None = None,
) -> Path:
    """Save ``peft_model``'s adapter (``adapter_model.safetensors`` + ``adapter_config.json``), from
    ``state_dict`` when given (whole tensors gathered from a sharded model), the ``chat_template``
    it was trained with (``chat_template.jinja``), which generation and export then use by default,
    and a ``tokenizer`` grown by new tokens. ``convert`` rewrites the saved adapter in its folder
    before it appears (a residual init's to plain LoRA)."""
    from peft import get_peft_model_state_dict

    check_finite(get_peft_model_state_dict(peft_model, state_dict=state_dict), f"adapter for {target}")
    with atomic_directory(target) as staging:
        # a grown vocabulary's rows are the adapter's own tensors: the loaders grow the base's rows, so
        # peft need not add copies of the whole embedding and head
        peft_model.save_pretrained(
            staging, safe_serialization=True, state_dict=state_dict, save_embedding_layers=False
        )
        if convert is not None:
            convert(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)  # its own chat_template.jinja, replaced just below
        if chat_template is not None:
            (staging / CHAT_TEMPLATE).write_text(chat_template, encoding="utf-8")
    return Path(target)


def adapter_chat_template(adapter: str | Path | None, override: str | None = None) -> str | None:
    """The chat template to use with ``adapter``: ``override`` when given, else the one saved with
    the adapter at training (``None`` without either: the tokenizer's own then applies)."""
    if override:
        return override
    path = Path(adapter) / CHAT_TEMPLATE if adapter else None
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None
