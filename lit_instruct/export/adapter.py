"""Adapters out of training: clean PEFT folders and merged standalone models.

Every write goes to a temporary folder beside the target that is renamed into place only when
complete, so a failure never leaves a half-written adapter or model, and an earlier one survives.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lit_instruct.adapter_folder import adapter_base, copy_adapter, read_weights
from lit_instruct.export.gguf_vocab import SENTENCEPIECE_MODEL
from lit_instruct.io import atomic_directory, check_finite

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
"""A vision-language model's processor files, copied into its merged model's folder."""

export_adapter = copy_adapter
"""``export --out``: the clean PEFT folder (:func:`lit_instruct.adapter_folder.copy_adapter`)."""


def merged_model(adapter: str | Path, base: str | None = None) -> tuple[Any, Any]:
    """``adapter`` merged into a full-precision (fp32) copy of its base, both checked finite, and the
    base's tokenizer; an adapter trained on an NF4 base merges into the fp32 base weights."""
    from peft import PeftModel

    from lit_instruct.models.load import load_base_model
    from lit_instruct.models.new_tokens import embedding_rows_for
    from lit_instruct.vocabulary import adapter_tokenizer

    adapter, base = Path(adapter), adapter_base(adapter, base)
    read_weights(adapter)  # checked finite before the base loads
    tokenizer = adapter_tokenizer(adapter, base)
    model = load_base_model(base, "float32")
    embedding_rows_for(model, tokenizer)  # the rows of tokens added at training
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    check_finite(dict(model.state_dict()), f"the merge of {adapter}")
    return model, tokenizer


def merge_adapter(adapter: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Merge ``adapter`` into a full-precision copy of its base and save a standalone model.

    The output (safetensors, config, tokenizer and chat template) loads with
    ``AutoModelForCausalLM.from_pretrained(out)`` (a vision-language model's with
    ``AutoModelForImageTextToText``, its processor's files copied beside it). ``base`` overrides the
    adapter's recorded ``base_model_name_or_path``.
    """
    from lit_instruct.model_names import resolve_model_path

    model, tokenizer = merged_model(adapter, base)
    model.config.use_cache = True
    with atomic_directory(out, setting="--out") as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        base_folder = Path(resolve_model_path(adapter_base(adapter, base)))
        for name in (SENTENCEPIECE_MODEL, *PROCESSOR_FILES):  # the pieces' scores a GGUF needs; images'
            if (base_folder / name).is_file() and not (staging / name).exists():
                shutil.copyfile(base_folder / name, staging / name)
    return Path(out)
