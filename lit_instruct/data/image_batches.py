"""A batch's images as its model takes them: the processor's image tensors for the samples that
show images, and the per-token image markers some models read (Gemma 3's bidirectional image
attention, Qwen-VL's positions), under ``batch["images"]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lit_instruct.data.images import open_image
from lit_instruct.data.render import Sample

TEXT_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "offset_mapping"}
)
"""What some processors return for images alone (Gemma 3's image tokens as text) that the batch's own
tokens already give."""


class ImageInputs:
    """``processor``'s tensors for a batch of samples (images decoded here, in the loader's
    workers): what the model's ``forward`` takes beside the token ids."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        names = set(getattr(processor, "model_input_names", ()))
        self.token_type_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in names), None)
        self.marks_tokens = (
            bool(getattr(processor, "return_mm_token_type_ids", False)) and self.token_type_key
        )

    def __call__(self, samples: Sequence[Sample], input_ids: torch.Tensor) -> dict[str, Any]:
        shown = [[open_image(reference) for reference in s.images] for s in samples if s.images]
        inputs: dict[str, Any] = {}
        if shown:
            from transformers import BatchFeature

            processed = self.processor(images=shown)  # tensors made below: text keys may be ragged
            kept = {key: value for key, value in processed.items() if key not in TEXT_KEYS}
            inputs = dict(BatchFeature(kept, tensor_type="pt"))
        if self.marks_tokens:
            assert self.token_type_key is not None
            marks = self.processor.create_mm_token_type_ids(input_ids.tolist())
            inputs[self.token_type_key] = torch.tensor(marks, dtype=torch.long)
        return inputs
