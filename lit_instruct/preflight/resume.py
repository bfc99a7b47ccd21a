"""The checkpoint a run resumes from, checked against the command line before any weights are read.

A resume takes the user's settings, never the checkpoint's: Lightning would bring a checkpoint's
hyper-parameters back over the command line, and with them ``trust_remote_code``, ``model`` (a folder
whose code then runs) and ``adapter_dir`` (a folder then replaced). What a checkpoint does fix is the
run's *structure* (:data:`RESUME_STRUCTURE`): the base, the adapter's shape and targets, the
quantization and the objective. Where the command line says otherwise the resume is refused, naming
both values. ``--ckpt_path last`` is resolved here too: the newest checkpoint under the run's folders
(whatever ``version_N`` it was written in), or a fresh start said in one line when there is none.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_instruct.errors import ConfigError
from lit_instruct.io import check_archive
from lit_instruct.model_names import portable_name

LORA_STRUCTURE = (
    "r",
    "alpha",
    "target_modules",
    "use_rslora",
    "use_dora",
    "init",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
)
"""The LoRA settings that shape what a checkpoint holds (dropout and LoRA+ are the user's to change)."""

RESUME_STRUCTURE = ("model", *(f"lora.{name}" for name in LORA_STRUCTURE), "quantization.method")
"""The module settings (under ``model.``) a checkpoint fixes, besides the objective; no other is read."""

METADATA_FILE = "meta.pt"
"""What a sharded (folder) checkpoint keeps beside its shards: hyper-parameters among them."""


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents without its tensors read into memory (``weights_only``, memory-mapped),
    its zip records' CRCs checked first: a bit flipped on disk is refused, never trained on."""
    path = Path(path)
    file = path / METADATA_FILE if path.is_dir() else path
    check_archive(file)
    return torch.load(file, weights_only=True, map_location="cpu", mmap=True)


def run_structure(module: Mapping[str, Any]) -> dict[str, Any]:
    """The structure a module's settings (a checkpoint's ``hyper_parameters``, or the command line's
    ``model`` settings completed) fix: :data:`RESUME_STRUCTURE` by dotted name, and ``objective``
    (``sft``, or the preference loss). A setting the mapping lacks is left out."""
    structure: dict[str, Any] = {}
    for setting in RESUME_STRUCTURE:
        value: Any = module
        for key in setting.split("."):
            value = value.get(key, _MISSING) if isinstance(value, Mapping) else _MISSING
        if value is not _MISSING:
            structure[setting] = value
    structure["objective"] = objective_label(module.get("objective"), module.get("preference"))
    return structure


def objective_label(objective: Any, preference: Any = None) -> str:
    """What a module's ``objective`` setting (a short name, or ``{class_path, init_args}``; the old
    ``preference`` settings) trains, as one comparable name: ``sft``, ``dpo``, ``kto``, or the
    lower-cased class name of another objective."""
    if isinstance(preference, Mapping):
        return str(preference.get("kind", "dpo"))
    if isinstance(objective, Mapping):
        objective = objective.get("class_path")
    if objective is None:
        return "sft"
    return str(objective).rpartition(".")[2].lower()


_MISSING = object()


def _same(setting: str, mine: Any, theirs: Any) -> bool:
    if setting == "model":
        return portable_name(str(mine)) == portable_name(str(theirs))
    if setting in ("lora.target_modules", "lora.modules_to_save"):
        return set(mine or []) == set(theirs or [])
    if isinstance(mine, int | float) and isinstance(theirs, int | float):
        return float(mine) == float(theirs)
    return mine == theirs


def check_resume_structure(module: Mapping[str, Any], checkpoint: str | Path) -> None:
    """Refuse a resume from ``checkpoint`` whose structure differs from the run's ``module`` settings
    (the command line's, with the adapter's structure applied when ``model.adapter`` is set).

    Raises:
        ConfigError: ``ckpt_path`` when the checkpoint cannot be read; else the first differing
            setting, naming both values.
    """
    try:
        hparams = checkpoint_metadata(checkpoint).get("hyper_parameters") or {}
    except (OSError, RuntimeError, ValueError, EOFError, zipfile.BadZipFile) as failure:
        first = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
        raise ConfigError("ckpt_path", f"{str(checkpoint)!r} cannot be read: {first}") from None
    if not hparams:
        return  # not a module of ours (a Trainer of another project): the strict load decides
    mine, theirs = run_structure(module), run_structure(hparams)
    for setting, value in theirs.items():
        if setting in mine and not _same(setting, mine[setting], value):
            name = f"model.{setting}"
            fix = (
                "resume with the config it was trained with"
                if setting == "objective"
                else (f"set {name}: {value!r} as it was")
            )
            raise ConfigError(
                name,
                f"{mine[setting]!r} differs from the checkpoint {str(checkpoint)!r}, trained with "
                f"{value!r}: a resume keeps the run's structure; {fix}, or start a new run without "
                "--ckpt_path",
            )


def run_folders(config: Mapping[str, Any]) -> list[Path]:
    """Where a run described by a parsed ``fit`` config writes checkpoints: its root folder, the
    loggers' ``save_dir`` and the checkpoint callbacks' ``dirpath`` (Lightning's ``lightning_logs``
    when none is set)."""
    trainer = config.get("trainer") or {}
    folders = [trainer.get("default_root_dir")]
    for key, setting in (("logger", "save_dir"), ("callbacks", "dirpath")):
        entries = trainer.get(key)
        for entry in entries if isinstance(entries, list) else [entries]:
            init = entry.get("init_args") if isinstance(entry, Mapping) else None
            folders.append((init or {}).get(setting))
    found = [Path(folder) for folder in folders if isinstance(folder, str | Path)]
    if not found:  # Lightning's defaults: a logger's lightning_logs/, or checkpoints/ without one
        found = [Path("checkpoints") if trainer.get("logger") in (False, []) else Path("lightning_logs")]
    return list(dict.fromkeys(found))


def newest_checkpoint(folders: list[Path]) -> Path | None:
    """The furthest checkpoint (``*.ckpt`` file, or sharded folder) under ``folders``: the highest
    ``global_step`` it records, then the most recently written (a copy without its times keeps its
    order); one that cannot be read counts last."""
    found = {
        path
        for folder in folders
        if folder.is_dir()
        for path in folder.rglob("*.ckpt")
        if path.is_file() or (path / METADATA_FILE).is_file()
    }
    return max(found, key=lambda path: (_recorded_step(path), path.stat().st_mtime_ns), default=None)


def _recorded_step(path: Path) -> int:
    try:
        file = path / METADATA_FILE if path.is_dir() else path
        step = torch.load(file, weights_only=True, map_location="cpu", mmap=True).get("global_step")
    except Exception:  # a damaged file: resuming from it is refused when it is chosen, so rank it last
        return -1
    return int(step) if isinstance(step, int) else -1


def resolve_last(config: Mapping[str, Any]) -> str | None:
    """``ckpt_path: last`` as the newest checkpoint of the run's folders, said in one line; ``None``
    (a fresh start, said too) when the run has written none yet, as a restart wrapper's first launch."""
    from lightning.pytorch.utilities import rank_zero_info

    folders = run_folders(config)
    found = newest_checkpoint(folders)
    where = ", ".join(str(folder) for folder in folders)
    if found is None:
        rank_zero_info(f"lit-instruct: --ckpt_path last: no checkpoint under {where} yet; starting at step 0")
        return None
    rank_zero_info(f"lit-instruct: --ckpt_path last: resuming from {found}")
    return str(found)
