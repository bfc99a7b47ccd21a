"""Model building: a ``transformers`` base (optionally 4-bit), LoRA on it, and what training needs
of it (packing, the fused output head, MoE router losses). Where a model name points is
:mod:`lit_instruct.model_names`."""
