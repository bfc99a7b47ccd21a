"""Try a model: load a base (and adapter) for generation; :func:`generate` answers with the same chat
template as training (:mod:`lit_instruct.models.generation`)."""

from __future__ import annotations

from typing import Any

from lit_instruct.models.generation import generate

__all__ = ["generate", "load_for_generation", "open_images", "processor_for"]


def processor_for(model: str | None, adapter: str | None, tokenizer: Any) -> Any:
    """The processor of the model that will answer (``None``: a text-only model), read before any
    weight."""
    from lit_instruct.adapter_folder import adapter_base
    from lit_instruct.data.processor import image_processor_of

    name = model or (adapter_base(adapter) if adapter else "smollm2-135m-instruct")
    return image_processor_of(name, tokenizer)


def open_images(paths: list[str], flag: str = "--image") -> list[Any]:
    """Each image of ``paths`` opened and decoded (RGB).

    Raises:
        ConfigError: naming ``flag`` and the file, for one that is missing or PIL cannot read.
    """
    from pathlib import Path

    from lit_instruct.data.images import check_image, image_reference, open_image
    from lit_instruct.data.records import DataError
    from lit_instruct.errors import ConfigError

    opened = []
    for path in paths:
        try:
            reference = image_reference(path, Path.cwd(), flag, path)
            check_image(reference, flag, path)
        except DataError as error:  # its message starts with the field, here the path itself
            raise ConfigError(flag, error.message.removeprefix(f"field '{path}': ")) from error
        opened.append(open_image(reference))
    return opened


def load_for_generation(
    model: str | None, adapter: str | None = None, dtype: str = "float32"
) -> tuple[Any, Any]:
    """Load a model (bundled name, folder or hub id; ``None``: the adapter's base, else the bundled
    SmolLM2), optionally with a PEFT adapter, in eval mode."""
    from peft import PeftModel

    from lit_instruct.adapter_folder import adapter_base
    from lit_instruct.models.load import load_base_model
    from lit_instruct.models.new_tokens import embedding_rows_for
    from lit_instruct.vocabulary import adapter_tokenizer

    if model is None:
        model = adapter_base(adapter) if adapter else "smollm2-135m-instruct"
    net = load_base_model(model, dtype)  # type: ignore[arg-type]
    tokenizer = adapter_tokenizer(adapter, model)
    if adapter:
        embedding_rows_for(net, tokenizer)
        net = PeftModel.from_pretrained(net, adapter)
    return net.eval(), tokenizer
