"""The decoder trunk of a causal LM: the module whose output's ``last_hidden_state`` the head reads."""

from __future__ import annotations

from typing import Any


def decoder_of(model: Any) -> Any:
    """``model.get_decoder()``, except where that is the causal LM itself (Llama 4's text model:
    its ``base_model_prefix`` names no attribute), then its ``model`` attribute."""
    decoder = model.get_decoder()
    if decoder is model and hasattr(model, "get_output_embeddings") and hasattr(model, "model"):
        return model.model
    return decoder


def parts_outside_decoder(model: Any) -> list[str]:
    """The names of a vision-language model's parts that are not its language model (vision tower,
    projector: the children of its multimodal core that hold no part of the decoder); ``[]`` for a
    causal LM."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return []
    decoder = decoder_of(model)
    core = model.base_model if model.base_model is not model else model
    prefix = next((name for name, module in model.named_modules() if module is core), "")
    outside = []
    for name, child in core.named_children():
        if child is decoder or any(module is decoder for module in child.modules()):
            continue
        if any(True for _ in child.parameters()):
            outside.append(f"{prefix}.{name}" if prefix else name)
    return outside
