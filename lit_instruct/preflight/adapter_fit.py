"""Whether a PEFT adapter folder fits a base model, from its ``adapter_config.json`` and the header of
its safetensors file: the adapter's own structure put on the base's weightless skeleton must give
every saved LoRA tensor a place of the same shape."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from lit_instruct.adapter_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_tensors, read_config
from lit_instruct.errors import ConfigError


def saved_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors file, read from its header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118


def check_adapter_folder(adapter: str, setting: str = "model.adapter") -> Path:
    """``adapter`` as a folder holding a PEFT adapter's config and weights.

    Raises:
        ConfigError: naming ``model.adapter`` and what is missing.
    """
    folder = Path(adapter).expanduser()
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / file).is_file():
            what = "no folder" if not folder.is_dir() else f"a folder without {file}"
            raise ConfigError(
                setting,
                f"{adapter!r} is {what}; give a PEFT adapter folder ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})",
            )
    try:
        saved = read_config(folder)
    except (OSError, ValueError) as failure:
        raise ConfigError(setting, f"{folder / ADAPTER_CONFIG} cannot be read: {failure}") from None
    kind = saved.get("peft_type") if isinstance(saved, dict) else None
    if kind != "LORA" or not isinstance(saved.get("r"), int):
        raise ConfigError(
            setting, f"{adapter!r} is a {kind or 'unknown'} adapter, not LoRA: LoRA adapters continue"
        )
    damage = safetensors_damage(folder / ADAPTER_WEIGHTS)
    if damage is not None:
        raise ConfigError(setting, f"{folder / ADAPTER_WEIGHTS} {damage}; write or copy the adapter again")
    return folder


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing (a truncated or cut-off file, a header that is
    no JSON, tensors past its end), read from its header and size alone; ``None`` when whole."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"is {size} bytes: too short for a safetensors file (truncated)"
        length = struct.unpack("<Q", prefix)[0]
        if 8 + length > size:
            return f"is truncated: its header says {8 + length} bytes of header, the file has {size}"
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return "has a header that is no JSON (not a safetensors file, or damaged)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", [])) == 2
    ]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated: {size} bytes where its tensors need {expected}"
    return None


def adapter_on_skeleton(adapter: str, skeleton: nn.Module, model: str) -> Any:
    """``skeleton`` (a base built on the meta device) wrapped in ``adapter``'s LoRA structure.

    Raises:
        ConfigError: ``model.adapter`` is no PEFT LoRA folder, or a saved LoRA tensor has no place
            of its shape in this base (an adapter of another base).
    """
    from peft import PeftConfig, get_peft_model

    folder = check_adapter_folder(adapter)
    config = PeftConfig.from_pretrained(str(folder))
    if str(config.peft_type) not in ("LORA", "PeftType.LORA"):
        raise ConfigError(
            "model.adapter", f"{adapter!r} is a {config.peft_type} adapter; LoRA adapters continue"
        )
    config.init_lora_weights = True  # the saved tensors replace whatever the init would set
    config.inference_mode = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            wrapped = get_peft_model(skeleton, config)
        except ValueError as failure:  # its target modules are not in this base
            raise _another_base(adapter, model, config, str(failure).splitlines()[0]) from None
    placed = {key: tuple(t.shape) for key, t in adapter_tensors(wrapped).items()}
    for key, shape in saved_shapes(folder / ADAPTER_WEIGHTS).items():
        if "lora_" not in key:  # grown embedding rows and modules saved whole: checked at load
            continue
        if key not in placed:
            raise _another_base(adapter, model, config, f"its tensor {key} has no place in this base")
        if placed[key] != shape:
            raise _another_base(
                adapter, model, config, f"{key} is {list(shape)} in the adapter, {list(placed[key])} here"
            )
    return wrapped


def _another_base(adapter: str, model: str, config: Any, detail: str) -> ConfigError:
    trained_on = getattr(config, "base_model_name_or_path", None)
    hint = f" (it was trained on {trained_on!r})" if trained_on else ""
    return ConfigError(
        "model.adapter",
        f"{adapter!r} does not fit model.model {model!r}: {detail}; an adapter of another base{hint}?",
    )
