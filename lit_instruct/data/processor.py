"""A vision-language model's processor: its image processor, image token and chat template, found
in the model's folder beside the tokenizer.

``transformers`` builds the processors that also take videos (Qwen-VL, SmolVLM) only with
torchvision, for their video processor, even where the images need none (their image processors
have a PIL backend). Without torchvision such a processor is built for images only: the same class
with its video processor left out, so images are processed exactly as the class processes them and
a video is never read.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Files whose presence in a model's folder says it takes images."""


def has_image_processor(folder: str | Path) -> bool:
    """Whether the model in ``folder`` comes with an image processor."""
    return any((Path(folder) / name).is_file() for name in PROCESSOR_FILES)


def hub_folder(repo_id: str) -> Path | None:
    """The local snapshot folder holding a hub model's processor file (downloaded once), ``None``
    when it has none (a text-only model)."""
    from transformers.utils import cached_file

    try:
        for name in PROCESSOR_FILES:
            found = cached_file(repo_id, name, _raise_exceptions_for_missing_entries=False)
            if found is not None:
                for other in (
                    "config.json",
                    "tokenizer_config.json",
                    "chat_template.jinja",
                    *PROCESSOR_FILES,
                ):
                    cached_file(repo_id, other, _raise_exceptions_for_missing_entries=False)
                return Path(found).parent
    except (OSError, ValueError):  # offline and not cached: a record with images then says no processor
        return None
    return None


def _processor_class_name(folder: Path) -> str | None:
    """The processor class a model's folder names (its ``processor_config.json``), else the one
    ``transformers`` maps its ``model_type`` to."""
    config = folder / "processor_config.json"
    if config.is_file():
        name = json.loads(config.read_text(encoding="utf-8")).get("processor_class")
        if isinstance(name, str):
            return name
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(folder).model_type)
    return name if isinstance(name, str) else None


def images_only(folder: Path) -> Any:
    """The processor of the model in ``folder`` without its video processor (``None`` when its class
    takes none, or cannot be found)."""
    from transformers.models.auto.processing_auto import processor_class_from_name

    name = _processor_class_name(folder)
    cls = processor_class_from_name(name) if name else None
    if cls is None or "video_processor" not in cls.get_attributes():
        return None
    kept = [attribute for attribute in cls.get_attributes() if attribute != "video_processor"]

    members = {"get_attributes": classmethod(lambda _: list(kept))}
    without_videos: Any = type(cls.__name__, (cls,), members)
    return without_videos.from_pretrained(folder, video_processor=None)  # SmolVLM's has no default


def image_processor_of(model: str, tokenizer: Any) -> Any:
    """The ``AutoProcessor`` of ``model`` (bundled name, folder or hub id) with ``tokenizer`` as its
    tokenizer (new tokens included), or ``None`` for a text-only model.

    Raises:
        ValueError: a processor ``transformers`` cannot build here (naming the package it lacks).
    """
    from transformers import AutoProcessor

    from lit_instruct.model_names import resolve_model_path

    location = resolve_model_path(model)
    found: Path | None = Path(location)
    if found is not None and not found.is_dir():  # a hub id: its processor files, through the hub's cache
        found = hub_folder(location)
    if found is None or not has_image_processor(found):
        return None
    folder = found
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except (AttributeError, ImportError, OSError, ValueError) as error:
        processor = images_only(folder) if importlib.util.find_spec("torchvision") is None else None
        if processor is None:
            raise ValueError(
                f"the processor of {model} cannot be built here ({type(error).__name__}: {error}); "
                "transformers needs torchvision for some processors: pip install torchvision"
            ) from error
        rank_zero_info(
            f"lit-instruct: {type(processor).__name__} built for images only (its video processor needs "
            "torchvision, which is not installed)"
        )
    if getattr(processor, "image_processor", None) is None:
        return None
    processor.tokenizer = tokenizer
    return processor
