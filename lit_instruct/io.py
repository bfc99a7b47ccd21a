"""Where a run writes, and writes that never leave a half-written result: a folder or a file appears
whole, or not at all, with the modes the umask allows; tensors checked finite before they are written."""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import socket
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lit_instruct.errors import ConfigError

OUTPUT_MARKER = ".lit-instruct"
"""The file in every folder lit-instruct writes whole (adapters, exports), listing what it wrote
there: a folder without it is the user's, and is never replaced; nor is one holding anything else."""

EARLIER_OUTPUT = re.compile(
    r"adapter_config\.json|adapter_model\.(safetensors|bin)|chat_template\.jinja|README\.md|config\.json"
    r"|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.json"
    r"|merges\.txt"
)
"""The names of what lit-instruct writes in an adapter or model folder: an unmarked folder holding
these only (and a config) is one an earlier version wrote, replaced as ours."""


@contextmanager
def named_on_failure(path: str | Path) -> Iterator[None]:
    """An ``OSError`` raised inside without a file name (a full disk on ``close``) names ``path``."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise


def check_replaceable(target: str | Path, setting: str) -> None:
    """Refuse ``target`` as a folder to write whole when it holds anything lit-instruct did not write
    there (its files would be deleted), or is a file. Ours: what :data:`OUTPUT_MARKER` lists, or, in
    a folder without it, an adapter or model folder of an earlier version (:data:`EARLIER_OUTPUT`).

    Raises:
        ConfigError: naming ``setting``, the folder, what is not ours and what would be right.
    """
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ConfigError(setting, f"{str(target)!r} is a file; name a folder to write into")
    entries = sorted(entry.name for entry in target.iterdir())
    foreign = [name for name in entries if name not in written_by_us(target, entries)]
    if foreign:
        raise ConfigError(
            setting,
            f"{str(target)!r} holds {len(foreign)} entries lit-instruct did not write "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), which writing the folder "
            "whole would delete; name a new or empty folder",
        )


def written_by_us(folder: Path, entries: list[str]) -> set[str]:
    """Which of ``folder``'s ``entries`` lit-instruct wrote (see :func:`check_replaceable`)."""
    marker = folder / OUTPUT_MARKER
    if marker.is_file():
        try:
            listed = json.loads(marker.read_text(encoding="utf-8")).get("entries")
        except (ValueError, AttributeError, OSError):
            listed = None
        if isinstance(listed, list):
            return {OUTPUT_MARKER, *map(str, listed)}
        return set(entries)  # a marker without a list: the first version that marked its folders
    earlier = {name for name in entries if EARLIER_OUTPUT.fullmatch(name)}
    is_output = {"adapter_config.json", "config.json"} & earlier
    return earlier if is_output and earlier == set(entries) else set()


@contextmanager
def atomic_directory(target: str | Path, replace: bool = True, setting: str | None = None) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``target``, on failure it is removed.

    ``setting`` (the setting that named ``target``): a folder the user named, marked as ours
    (:data:`OUTPUT_MARKER`) and never replacing a folder that is not (:func:`check_replaceable`).
    ``replace=False`` (a content-addressed cache, filled by several processes or nodes at once):
    a ``target`` that another process put in place first is kept, and the staging folder dropped.
    Leftovers of writes killed midway (staging folders of dead processes, a retired ``-old``
    folder) are removed first; files and folders reach the disk (fsync) before the rename."""
    target = Path(target)
    if setting is not None:
        check_replaceable(target, setting)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(target)}{os.getpid()}-", dir=target.parent))
    try:
        with named_on_failure(target):
            yield staging
        if setting is not None:
            entries = sorted(entry.name for entry in staging.iterdir())
            (staging / OUTPUT_MARKER).write_text(
                json.dumps({"written_by": "lit-instruct", "what": setting, "entries": entries}) + "\n",
                encoding="utf-8",
            )
        _as_umask_allows(staging)
        _sync_tree(staging)
        if not replace:
            try:
                staging.rename(target)
            except OSError:  # already there (ENOTEMPTY / EEXIST): the same contents by its key
                if not target.is_dir():
                    raise
                shutil.rmtree(staging, ignore_errors=True)
            sync_folder(target.parent)
            return
        if target.exists():
            retired = _retired(target)
            shutil.rmtree(retired, ignore_errors=True)
            target.rename(retired)
            staging.rename(target)
            sync_folder(target.parent)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
            sync_folder(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_prefix(target: Path) -> str:
    """How temporary files and folders beside ``target`` begin (the process id follows): hidden, and
    naming the host and its process-id namespace (containers sharing a host name each have their
    own), so that only this host's dead writers' leftovers are removed."""
    return f".{target.name}-{socket.gethostname()}-{_pid_namespace()}-"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def _retired(target: Path) -> Path:
    return target.with_name(f".{target.name}-old")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(target: Path) -> None:
    """Remove what writes of ``target`` killed midway left beside it: staging folders and temporary
    files of this host's processes that are gone, and a retired ``-old`` folder once ``target`` is
    back in place (while it is missing, the retired folder is the last good copy: kept)."""
    prefix = staging_prefix(target)
    for entry in target.parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix) :].split("-", 1)[0].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    if target.exists():
        shutil.rmtree(_retired(target), ignore_errors=True)


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder`` and the folders themselves."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for path in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        sync_folder(path)


def sync_folder(folder: Path) -> None:
    """fsync a folder: a rename in it survives a power cut."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # cannot sync folders: fine
            raise
    finally:
        os.close(handle)


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
    remove_leftovers(target)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f"{staging_prefix(target)}{os.getpid()}.")
    try:
        with named_on_failure(target), os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
        sync_folder(target.parent)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def log_dir(trainer: Any) -> Path:
    """A Lightning Trainer's log directory, else its root directory.

    Under DDP ``trainer.log_dir`` is broadcast from rank 0, a collective: call this on every rank,
    before any ``is_global_zero`` branch, or the run hangs.
    """
    return Path(trainer.log_dir or trainer.default_root_dir)


def checkpoint_dir(trainer: Any) -> Path:
    """The ``ModelCheckpoint`` folder, else ``<log dir>/checkpoints`` (call it on every rank)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return log_dir(trainer) / "checkpoints"


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise if any tensor holds NaN or Inf, naming the first such tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: tensor {name!r} contains NaN or Inf; refusing to write it")


def check_archive(file: Path) -> None:
    """Raise ``ValueError`` naming ``file`` when one of its zip records fails its CRC (``torch.load``
    does not check them)."""
    if not zipfile.is_zipfile(file):
        return  # torch's legacy format: nothing to check, torch.load reads it
    with zipfile.ZipFile(file) as archive:
        try:
            bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as failure:
            raise ValueError(f"{file} is damaged: {failure}") from None
    if bad is not None:
        raise ValueError(f"{file} is damaged: its record {bad!r} fails its CRC check")
