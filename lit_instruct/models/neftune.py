"""NEFTune (noisy embeddings for fine-tuning) on a model's input embeddings, by ``transformers``' own
hook: the noise TRL's ``SFTTrainer`` adds, drawn from the same generator in the same order."""

from __future__ import annotations

from typing import Any


def add_embedding_noise(model: Any, alpha: float) -> Any:
    """Add uniform noise of scale ``alpha / sqrt(length * hidden)`` to ``model``'s input embeddings
    whenever the embedding module is in training mode (a PEFT model or a ``transformers`` one);
    returns the hook's handle. ``alpha`` is checked with the other model settings
    (``model.neftune_noise_alpha`` in :mod:`lit_instruct.rules`), before any weight is read."""
    from transformers.integrations.neftune import activate_neftune

    return activate_neftune(model, float(alpha))
