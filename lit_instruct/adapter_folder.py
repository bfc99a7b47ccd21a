"""The PEFT adapter folder: its file names, and every read and write of it.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (what peft reads), the chat
template it was trained with (``chat_template.jinja``), a tokenizer when training grew the vocabulary,
and peft's model card (``README.md``). Its base is recorded as users and the Hub know it
(:func:`lit_instruct.model_names.portable_name`), never as this machine's cache path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lit_instruct.io import atomic_directory, check_finite
from lit_instruct.model_names import portable_name

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
"""The chat template an adapter was trained with, beside it (the name ``transformers`` uses)."""
TOKENIZER_CONFIG = "tokenizer_config.json"
MODEL_CARD = "README.md"


def read_config(folder: str | Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``."""
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text(encoding="utf-8"))


def write_config(folder: str | Path, config: dict[str, Any]) -> None:
    """Write ``config`` as the adapter's ``adapter_config.json`` (inside a folder being staged)."""
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors, checked finite."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    weights = load_file(path)
    check_finite(weights, str(path))
    return weights


def write_weights(folder: str | Path, weights: dict[str, torch.Tensor]) -> None:
    """Write ``weights`` as the adapter's safetensors file (inside a folder being staged)."""
    from safetensors.torch import save_file

    save_file(weights, Path(folder) / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def adapter_base(adapter: str | Path, base: str | None = None) -> str:
    """The base model of ``adapter``: ``base`` when given, else its recorded ``base_model_name_or_path``."""
    return base or read_config(adapter)["base_model_name_or_path"]


def adapter_chat_template(adapter: str | Path | None, override: str | None = None) -> str | None:
    """The chat template to use with ``adapter``: ``override`` when given, else the one saved with
    the adapter at training (``None`` without either: the tokenizer's own then applies)."""
    if override:
        return override
    path = Path(adapter) / CHAT_TEMPLATE if adapter else None
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None


def has_tokenizer(adapter: str | Path | None) -> bool:
    """Whether training saved a (grown) tokenizer with ``adapter``."""
    return adapter is not None and (Path(adapter) / TOKENIZER_CONFIG).is_file()


def record_base(folder: Path, base: str) -> None:
    """Name the adapter's base ``base`` in its config and in peft's model card (``base_model``)."""
    config = read_config(folder)
    config["base_model_name_or_path"] = base
    write_config(folder, config)
    card = folder / MODEL_CARD
    if card.is_file():
        from huggingface_hub import ModelCard

        model_card = ModelCard.load(card)
        model_card.data["base_model"] = base
        model_card.save(card)


def adapter_tensors(peft_model: Any, state_dict: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their saved names, as :func:`save_adapter` writes them.

    ``save_embedding_layers=False`` as in the save: peft's default (``"auto"``) asks the Hub whether the
    base's vocabulary changed, a network call (or, offline, a "Could not find a config file" warning)
    for a base named by its hub id; a grown vocabulary's rows are the adapter's own tensors anyway."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=state_dict, save_embedding_layers=False)


def save_adapter(
    peft_model: Any,
    target: str | Path,
    state_dict: dict[str, Any] | None = None,
    chat_template: str | None = None,
    tokenizer: Any = None,
    convert: Callable[[Path], None] | None = None,
    base: str | None = None,
    setting: str = "model.adapter_dir",
    card: str | None = None,
) -> Path:
    """Save ``peft_model``'s adapter (``adapter_model.safetensors`` + ``adapter_config.json``), from
    ``state_dict`` when given (whole tensors gathered from a sharded model), the ``chat_template``
    it was trained with (``chat_template.jinja``), which generation and export then use by default,
    and a ``tokenizer`` grown by new tokens. ``convert`` rewrites the saved adapter in its folder
    before it appears (a residual init's to plain LoRA); ``base``, the model name the user gave, is
    recorded as its portable name. ``setting`` names the folder in the error when it holds files
    lit-instruct did not write (:func:`~lit_instruct.io.check_replaceable`): it is never replaced.
    ``card``: the model card (``README.md``) to write instead of peft's."""
    check_finite(adapter_tensors(peft_model, state_dict), f"adapter for {target}")
    with atomic_directory(target, setting=setting) as staging:
        # a grown vocabulary's rows are the adapter's own tensors: the loaders grow the base's rows, so
        # peft need not add copies of the whole embedding and head
        peft_model.save_pretrained(
            staging, safe_serialization=True, state_dict=state_dict, save_embedding_layers=False
        )
        if convert is not None:
            convert(staging)
        if base is not None:
            record_base(staging, portable_name(base))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)  # its own chat_template.jinja, replaced just below
        if chat_template is not None:
            (staging / CHAT_TEMPLATE).write_text(chat_template, encoding="utf-8")
        if card is not None:  # over peft's, which knows neither the data nor how it was trained
            (staging / MODEL_CARD).write_text(card, encoding="utf-8")
    return Path(target)


def copy_adapter(adapter: str | Path, out: str | Path) -> Path:
    """Copy ``adapter`` into a clean PEFT folder: config and weights (checked finite), its chat
    template and grown tokenizer when it has them, its base named portably; nothing else."""
    adapter = Path(adapter)
    weights = read_weights(adapter)
    config = read_config(adapter)
    config["base_model_name_or_path"] = portable_name(config["base_model_name_or_path"])
    template = adapter_chat_template(adapter)
    with atomic_directory(out, setting="--out") as staging:
        write_weights(staging, weights)
        write_config(staging, config)
        if has_tokenizer(adapter):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(adapter).save_pretrained(staging)
        if template is not None:
            (staging / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    return Path(out)
