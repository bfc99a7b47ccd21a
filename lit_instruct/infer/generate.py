"""Try a model: load a base (and adapter) for generation; :func:`generate` answers with the same chat
template as training (:mod:`lit_instruct.models.generation`)."""

from __future__ import annotations

from typing import Any

from lit_instruct.models.generation import generate

__all__ = ["generate", "load_for_generation"]


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
