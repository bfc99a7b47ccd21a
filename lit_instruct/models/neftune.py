"""NEFTune (noisy embeddings for fine-tuning) on a model's input embeddings, by ``transformers``' own
hook: the noise TRL's ``SFTTrainer`` adds, drawn from the same generator in the same order."""

from __future__ import annotations

from typing import Any

from lit_instruct.errors import ConfigError


def add_embedding_noise(model: Any, alpha: float) -> Any:
    """Add uniform noise of scale ``alpha / sqrt(length * hidden)`` to ``model``'s input embeddings
    whenever the embedding module is in training mode (a PEFT model or a ``transformers`` one);
    returns the hook's handle.

    Raises:
        ConfigError: naming ``model.neftune_noise_alpha`` for an ``alpha`` that is not positive.
    """
    from transformers.integrations.neftune import activate_neftune

    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0:
        raise ConfigError("model.neftune_noise_alpha", f"must be a positive number or null, got {alpha!r}")
    return activate_neftune(model, float(alpha))
