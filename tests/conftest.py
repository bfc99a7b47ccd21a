"""Shared fixtures: the real SmolLM2 tokenizer, and a tiny random Llama that uses it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The bundled SmolLM2-135M-Instruct, prepared into the cache once."""
    from lit_instruct.model_names import prepare_smollm2

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


CHATS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris.")],
    [("user", "Say hello."), ("assistant", "Hello!"), ("user", "Again, louder."), ("assistant", "HELLO!")],
    [("system", "You answer in one word."), ("user", "Colour of the sky?"), ("assistant", "Blue.")],
    [("user", "2+2?"), ("assistant", "4")],
    [("user", "Name a fruit."), ("assistant", "An apple, which is crunchy and sweet.")],
    [("user", "Spell cat."), ("assistant", "C-A-T.")],
]


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    """A small chat JSONL file: single and multi-turn, with and without a system turn."""
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in CHATS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def _finish_wandb_runs():
    """A W&B run left open by one test would be reused by the next one's logger: close it."""
    yield
    import wandb

    if wandb.run is not None:
        wandb.finish()
