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
