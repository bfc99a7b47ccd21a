"""Lightning callbacks for instruction tuning, installed as ``lit_instruct.callbacks``."""

from lit_instruct.callbacks.generation_preview import GenerationPreview

__all__ = ["GenerationPreview"]
