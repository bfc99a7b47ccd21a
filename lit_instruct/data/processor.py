"""A vision-language model's processor: its image processor, image token and chat template, found
in the model's folder beside the tokenizer.

``transformers`` builds the processors that also take videos (Qwen-VL, SmolVLM) only with
torchvision, for their video processor, even where the images need none (their image processors
have a PIL backend). Without torchvision such a processor is built for images only: the same class
with its video processor left out, so images are processed exactly as the class processes them and
a video is never read. Pixtral's processor (Mistral 3) imports a helper from its torchvision image
processor module: it is read with the PIL image processor's module, which has the same helper.
Llama 4's image processor has no PIL backend: it needs torchvision.
"""

from __future__ import annotations

import contextlib
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


def processor_class(name: str) -> Any:
    """The ``transformers`` processor class ``name``; where its module imports a helper from the
    family's torchvision image processor module (Pixtral's, for Mistral 3) and torchvision is not
    installed, that module is read with the family's PIL image processor module standing for it (the
    same helpers, its PIL backend). ``None`` when there is no such class, or it cannot be read here."""
    import sys

    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    cls = processor_class_from_name(name)
    if cls is not None and not getattr(cls, "is_dummy", False):
        return cls
    model_type = next((key for key, value in PROCESSOR_MAPPING_NAMES.items() if value == name), None)
    if model_type is None or importlib.util.find_spec("torchvision") is not None:
        return cls
    family = f"transformers.models.{model_type}"
    with contextlib.suppress(ImportError):
        pil = importlib.import_module(f"{family}.image_processing_pil_{model_type}")
        standing = f"{family}.image_processing_{model_type}"
        saved = sys.modules.get(standing)
        sys.modules[standing] = pil
        try:
            module = importlib.import_module(f"{family}.processing_{model_type}")
        finally:
            if saved is None:
                sys.modules.pop(standing, None)
            else:
                sys.modules[standing] = saved
        return getattr(module, name, None)
    return None


def images_only(folder: Path) -> Any:
    """The processor of the model in ``folder`` built without torchvision: without its video processor
    (Qwen-VL, SmolVLM), or read with its PIL image processor's helpers (:func:`processor_class`);
    ``None`` when neither applies."""
    name = _processor_class_name(folder)
    cls = processor_class(name) if name else None
    if cls is None:
        return None
    if "video_processor" not in cls.get_attributes():
        return cls.from_pretrained(folder)
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

    location = resolve_model_path(model)  # a folder, or a hub id: its processor files through the hub's cache
    folder = Path(location) if Path(location).is_dir() else hub_folder(location)
    if folder is None or not has_image_processor(folder):
        return None
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
            f"lit-instruct: {type(processor).__name__} built without torchvision (not installed): for "
            "images only, through its image processor's PIL backend"
        )
    if getattr(processor, "image_processor", None) is None:
        return None
    processor.tokenizer = tokenizer
    return processor
