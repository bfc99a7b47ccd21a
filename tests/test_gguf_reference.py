"""Our GGUF files equal llama.cpp's own converter's, key by key and byte by byte, for every family we
write (tiny random models with SmolLM2's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

from lit_instruct.export.gguf import SUPPORTED, rope_factors, write_gguf
from tests.llama_cpp import contents, convert, convert_many, differences
from tests.sentencepiece_vocab import PIECES, STYLES, as_the_hub_ships_it, sentencepiece_tokenizer

pytestmark = pytest.mark.slow  # llama.cpp's converter in a subprocess: `make test-fast` leaves it out

BASE = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": 408}  # 8 rows past the pieces
PHI3_MINI = {"pad_token_id": 0, "eos_token_id": 2, "sliding_window": 63, "vocab_size": 404}
FAMILIES = {  # name: (config class, settings, tokenizer class in tokenizer_config.json, SentencePiece style)
    "llama": ("LlamaConfig", {}, None, None),
    "llama-head-dim": ("LlamaConfig", {"head_dim": 32}, None, None),  # head_dim != hidden / heads
    "llama-3.1": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE}, None, None),
    "llama-2": ("LlamaConfig", {"vocab_size": 400}, None, "llama"),
    "mistral": ("MistralConfig", {"sliding_window": None, "tie_word_embeddings": False}, None, None),
    "mistral-v0.3": ("MistralConfig", {"sliding_window": None, "vocab_size": 400}, None, "llama"),
    "qwen2": ("Qwen2Config", {}, None, None),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, None, None),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "sliding_window": None}, "GPT2Tokenizer", None),  # Phi-4
    "phi3-mini": ("Phi3Config", PHI3_MINI, None, "phi3"),
    "gemma2": ("Gemma2Config", GEMMA, None, "gemma"),
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "final_logit_softcapping": 30.0}, None, "gemma"),
}


def tiny_model(name: str, tokenizer, folder: Path, **overrides: Any) -> Path:
    """A tiny random model of ``name`` with random norms (an offset would show), saved with its
    tokenizer: SmolLM2's byte-level BPE, or a SentencePiece vocabulary in the family's style
    (``overrides``: config settings over the family's)."""
    cls, settings, tokenizer_class, style = FAMILIES[name]
    settings = {**settings, **overrides}
    if style is not None:
        sentencepiece_tokenizer(style, folder)
    else:
        tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **settings}))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    if tokenizer_class:
        config = folder / "tokenizer_config.json"
        config.write_text(config.read_text().replace('"TokenizersBackend"', f'"{tokenizer_class}"'))
    return folder


def test_every_supported_family_is_checked_here() -> None:
    checked = {getattr(transformers, cls).model_type for cls, *_ in FAMILIES.values()}
    assert checked == set(SUPPORTED)


def quants(name: str) -> tuple[str, ...]:
    return ("f32", "q8_0") if name == "llama" else ("f16",)  # quantizing is family-blind


@pytest.fixture(scope="module")
def converted(tokenizer, tmp_path_factory) -> tuple[Path, dict[Path, str]]:
    """Every family's tiny model (``folder/name/model``) converted by llama.cpp in one process (its
    imports paid once), with the traceback of each conversion that failed."""
    folder = tmp_path_factory.mktemp("families")
    jobs = []
    for name in FAMILIES:  # the converter reads the family off the folder's config
        model_dir = tiny_model(name, tokenizer, folder / name / "model")
        pre = None if FAMILIES[name][3] else "smollm"
        jobs += [(model_dir, folder / name / f"theirs-{quant}.gguf", quant, pre) for quant in quants(name)]
    return folder, convert_many(jobs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_our_gguf_equals_llama_cpps_converter(name, converted) -> None:
    folder, failed = converted
    model = AutoModelForCausalLM.from_pretrained(folder / name / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder / name / "model")
    pre = None if FAMILIES[name][3] else "smollm"
    for quant in quants(name):
        theirs = folder / name / f"theirs-{quant}.gguf"
        assert theirs not in failed, failed.get(theirs)
        ours = write_gguf(model, tokenizer, folder / name / f"ours-{quant}.gguf", quant, tokenizer_pre=pre)
        assert differences(ours, theirs) == [], f"{name} {quant}"


ODD_TOKENS = {  # text: (special, normalized), added after the vocabulary
    "oddtok": (False, False),  # an ordinary word: user-defined
    "\u2581lead": (False, False),  # user-defined: `▁` written as a space
    "x\u2581y": (False, False),
    "\u0120gx": (False, False),  # byte-level: decoded, `Ġ` a space
    "\u0120gnorm": (False, True),  # normalized: not decoded
    "<|foo|>": (False, False),  # not marked special but looks it: control
    "<unused7>": (False, False),
    "<extra_special>": (True, False),  # special: control, text unchanged
    "\u2581sp": (True, False),
}


def model_with_odd_tokens(name: str, tokenizer, folder: Path) -> Path:
    """:func:`tiny_model` of ``name`` whose tokenizer has :data:`ODD_TOKENS` added, with embedding rows
    for them and a few past them."""
    style = FAMILIES[name][3]
    before = PIECES + len(STYLES[style]["added"]) if style else len(tokenizer)
    tiny_model(name, tokenizer, folder, vocab_size=before + len(ODD_TOKENS) + 3)
    grown = AutoTokenizer.from_pretrained(folder)
    for text, (special, normalized) in ODD_TOKENS.items():
        grown.add_tokens([AddedToken(text, special=special, normalized=normalized)], special_tokens=special)
    assert len(grown) == before + len(ODD_TOKENS)
    grown.save_pretrained(folder)
    if style:
        as_the_hub_ships_it(grown, folder / "tokenizer_config.json")
    return folder


VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "llama-2", "phi3-mini"])  # byte-level, SentencePiece, Phi-3's
def test_item14_added_tokens_typed_as_llama_cpp(name, tokenizer, tmp_path) -> None:
    """Every added token's text and type (and score) as the converter writes them: special, looking
    special, with `▁` or `Ġ`, normalized or not."""
    folder = model_with_odd_tokens(name, tokenizer, tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pre = None if FAMILIES[name][3] else "smollm"
    theirs, _ = contents(convert(folder, tmp_path / "theirs.gguf", tokenizer_pre=pre))
    grown = AutoTokenizer.from_pretrained(folder)
    ours, _ = contents(write_gguf(model, grown, tmp_path / "ours.gguf", tokenizer_pre=pre))
    for key in VOCABULARY_KEYS:
        if key in theirs or key in ours:
            assert len(ours[key]) == len(theirs[key]) == model.config.vocab_size, key
            pairs = enumerate(zip(ours[key], theirs[key], strict=True))
            assert [(i, a, b) for i, (a, b) in pairs if a != b] == [], f"{key}: (id, ours, llama.cpp)"


def test_llama3_rope_factors_match_transformers_own_scaled_frequencies() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**{**BASE, "rope_scaling": LLAMA3_ROPE})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    torch.testing.assert_close(rope_factors(config), plain / scaled)
    assert rope_factors(config).max() == 8.0 and rope_factors(config).min() == 1.0


MODEL_CARD_KEYS = {"general.name", "general.tags"} | {
    f"general.base_model.{key}" for key in ("count", "0.name", "0.repo_url", "0.organization")
}
"""What the converter reads off the model card peft writes beside the adapter (ours names the adapter)."""


def trained_adapter(base: Path, folder: Path, **lora) -> Path:
    """An adapter on ``base`` with non-zero B matrices, saved as training saves it."""
    from lit_instruct.adapter_folder import save_adapter
    from lit_instruct.models.load import load_base_model
    from lit_instruct.models.lora import LoRAConfig, attach_lora

    torch.manual_seed(0)
    model = attach_lora(load_base_model(str(base)), LoRAConfig(**{"r": 4, "alpha": 8, **lora}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return save_adapter(model, folder)


@pytest.mark.parametrize(("name", "quant"), [("llama", "f32"), ("llama", "q8_0"), ("phi3", "f16")])
def test_our_lora_gguf_equals_llama_cpps_lora_converter(name, quant, tokenizer, tmp_path) -> None:
    from lit_instruct.export.gguf_lora import write_lora_gguf
    from tests.llama_cpp import convert_lora

    base = tiny_model(name, tokenizer, tmp_path / "model")
    adapter = trained_adapter(base, tmp_path / "adapter")
    theirs = convert_lora(adapter, base, tmp_path / "theirs.gguf", quant)
    ours = write_lora_gguf(adapter, tmp_path / "ours.gguf", quant)
    assert differences(ours, theirs, MODEL_CARD_KEYS) == []


def test_an_rslora_adapter_on_the_base_gguf_gives_the_merged_gguf(tokenizer, tmp_path) -> None:
    """llama.cpp adds ``alpha / r * B @ A`` to each base weight: with our alpha that is the merge peft
    itself computes (rsLoRA's ``alpha / sqrt(r)`` included), tensor by tensor in the GGUF layout."""
    from lit_instruct.export.adapter import merged_model
    from lit_instruct.export.gguf_lora import write_lora_gguf

    base = tiny_model("llama", tokenizer, tmp_path / "model")
    adapter = trained_adapter(base, tmp_path / "adapter", use_rslora=True)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _, base_tensors = contents(write_gguf(base_model, tokenizer, tmp_path / "base.gguf", "f32"))
    merged, _ = merged_model(adapter)
    _, merged_tensors = contents(write_gguf(merged, tokenizer, tmp_path / "merged.gguf", "f32"))
    metadata, lora = contents(write_lora_gguf(adapter, tmp_path / "lora.gguf"))
    scale = float(metadata["adapter.lora.alpha"]) / 4
    assert scale == pytest.approx(8 / 4**0.5)  # rsLoRA: alpha / sqrt(r), not alpha / r
    adapted = [name.removesuffix(".lora_a") for name in lora if name.endswith(".lora_a")]
    assert len(adapted) == 14  # 7 linear layers x 2 decoder layers
    for name in adapted:
        a, b = (torch.from_numpy(lora[f"{name}.lora_{x}"][2]) for x in "ab")
        expected = torch.from_numpy(base_tensors[name][2]) + scale * b @ a
        torch.testing.assert_close(expected, torch.from_numpy(merged_tensors[name][2]), rtol=1e-5, atol=1e-6)


def test_what_a_gguf_lora_cannot_hold_is_refused(tokenizer, tmp_path) -> None:
    from lit_instruct.export.gguf_lora import write_lora_gguf

    base = tiny_model("llama", tokenizer, tmp_path / "model")
    adapter = trained_adapter(base, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        write_lora_gguf(adapter, tmp_path / "lora.gguf")
    assert not (tmp_path / "lora.gguf").exists()


@pytest.mark.parametrize(
    ("name", "change", "refusal"),
    [
        ("gemma2", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar"),  # llama.cpp: 1/sqrt(head_dim)
        ("gemma2", {"rope_theta": 500000.0}, "rope_theta 10000"),
        ("gemma3", {"layer_types": ["full_attention", "sliding_attention"]}, "every 6th layer global"),
    ],
)
def test_gemma_settings_llama_cpp_would_run_differently_are_refused(name, change, refusal, tmp_path) -> None:
    cls, settings, _, _ = FAMILIES[name]
    config = getattr(transformers, cls)(**{**BASE, **settings, **change})
    model = AutoModelForCausalLM.from_config(config)
    tokenizer = sentencepiece_tokenizer("gemma", tmp_path / "tokenizer")
    with pytest.raises(ValueError, match=refusal):
        write_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_a_sentencepiece_vocabulary_needs_its_tokenizer_model(tmp_path) -> None:
    """The pieces' scores are only in ``tokenizer.model``: without it, no file; a ``tokenizer.model``
    of another vocabulary is refused too."""
    cls, settings, _, _ = FAMILIES["llama-2"]
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **settings}))
    sentencepiece_tokenizer("llama", tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.model").unlink()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"none was found .*tokenizer\.model"):
        write_gguf(model, tokenizer, tmp_path / "model.gguf")
    other = sentencepiece_tokenizer("gemma", tmp_path / "gemma").vocab_file
    with pytest.raises(ValueError, match="is not this tokenizer's vocabulary"):
        write_gguf(model, tokenizer, tmp_path / "model.gguf", sentencepiece=Path(other))
    assert not (tmp_path / "model.gguf").exists()


def test_the_tests_gguf_reader_reads_what_gguf_py_reads(tokenizer, tmp_path) -> None:
    """``tests.llama_cpp.contents`` (which every comparison here uses) against gguf-py's own reader, on
    a quantized file with a byte-level vocabulary and merges and on a LoRA file."""
    import gguf
    import numpy as np

    from lit_instruct.export.gguf_lora import write_lora_gguf

    base = tiny_model("llama", tokenizer, tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    written = [write_gguf(model, tokenizer, tmp_path / "q8.gguf", "q8_0", tokenizer_pre="smollm")]
    adapter = trained_adapter(base, tmp_path / "adapter")
    written.append(write_lora_gguf(adapter, tmp_path / "lora.gguf", "f16"))
    for path in written:
        reader = gguf.GGUFReader(path)
        metadata, tensors = contents(path)
        assert metadata == {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
        assert list(tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            shape, kind, data = tensors[t.name]
            assert (shape, kind) == (tuple(int(n) for n in t.shape), t.tensor_type.name)
            expected = np.array(t.data)
            assert (data.dtype, data.shape) == (expected.dtype, expected.shape), t.name
            assert np.array_equal(data.view(np.uint8), expected.view(np.uint8)), t.name
