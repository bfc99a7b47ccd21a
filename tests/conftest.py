"""Shared fixtures: the real SmolLM2 tokenizer, and a tiny random Llama that uses it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The bundled SmolLM2-135M-Instruct, prepared into the cache once."""
    from lit_instruct.models import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's vocabulary and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
