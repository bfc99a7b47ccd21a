"""Tiny SentencePiece vocabularies (BPE with byte fallback, trained in milliseconds on text that ships
with ``transformers``) in the shapes of Llama 2 / Mistral, Phi-3 mini and Gemma, saved as those models
ship them: ``tokenizer.model`` beside the ``transformers`` tokenizer's files."""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers

STYLES: dict[str, dict[str, Any]] = {
    "llama": {"pieces": {"unk": "<unk>", "bos": "<s>", "eos": "</s>"}, "dummy_prefix": True, "added": {}},
    "phi3": {  # Phi-3 mini: chat markers added after the pieces, some not marked special
        "pieces": {"unk": "<unk>", "bos": "<s>", "eos": "</s>"},
        "dummy_prefix": True,
        "added": {"<|endoftext|>": True, "<|assistant|>": True, "<|end|>": True, "<|user|>": False},
    },
    "gemma": {  # Gemma: no space prefix, turn markers among the pieces, <mask> not marked special
        "pieces": {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"},
        "user_defined": ["<mask>", "<start_of_turn>", "<end_of_turn>"],
        "dummy_prefix": False,
        "added": {},
    },
}
PIECES = 400


def corpus() -> list[str]:
    """Non-empty lines of ``transformers``' own source: code, prose, punctuation."""
    return [line for line in inspect.getsource(transformers.GenerationConfig).splitlines() if line.strip()]


def sentencepiece_tokenizer(style: str, folder: Path) -> Any:
    """A ``style`` vocabulary trained, loaded by its family's ``transformers`` class and saved into
    ``folder`` with its ``tokenizer.model``."""
    import sentencepiece

    settings = STYLES[style]
    names = settings["pieces"]
    ids = {f"{kind}_id": i for i, kind in enumerate(names)} | {
        f"{kind}_piece": p for kind, p in names.items()
    }
    ids |= {f"{kind}_id": -1 for kind in ("unk", "bos", "eos", "pad") if kind not in names}
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus()),
            model_prefix=f"{scratch}/tokenizer",
            vocab_size=PIECES,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            add_dummy_prefix=settings["dummy_prefix"],
            remove_extra_whitespaces=False,  # as Llama 2, Mistral and Gemma: runs of spaces, newlines
            normalization_rule_name="identity",  # and tabs kept
            user_defined_symbols=settings.get("user_defined", []),
            minloglevel=2,
            **ids,
        )
        shutil.copyfile(f"{scratch}/tokenizer.model", folder / "tokenizer.model")
    cls = transformers.GemmaTokenizer if style == "gemma" else transformers.LlamaTokenizer
    tokens = {f"{kind}_token": piece for kind, piece in names.items()}
    tokenizer = cls.from_pretrained(folder, add_bos_token=True, **tokens)
    for text, special in settings["added"].items():
        tokenizer.add_tokens([transformers.AddedToken(text, special=special, normalized=False)], special)
    tokenizer.save_pretrained(folder)
    as_the_hub_ships_it(tokenizer, folder / "tokenizer_config.json")
    return tokenizer


def as_the_hub_ships_it(tokenizer: Any, config_file: Path) -> None:
    """``added_tokens_decoder`` and ``add_bos_token``/``add_eos_token`` written into the tokenizer's
    config, as ``transformers`` 4 saved the Llama 2, Mistral, Phi-3 and Gemma folders on the Hub
    (``transformers`` 5 keeps them in ``tokenizer.json`` only)."""
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tokenizer.added_tokens_decoder.items())
    }
    config |= {"add_bos_token": True, "add_eos_token": False}
    config_file.write_text(json.dumps(config, indent=2))
