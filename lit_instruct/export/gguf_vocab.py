"""A tokenizer -> GGUF's vocabulary keys, as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

Two kinds: **byte-level BPE** (``tokenizer.ggml.model: gpt2``: tokens, types, merges and the
pre-tokenizer's name; SmolLM2, Llama 3, Qwen, Phi-4) and **SentencePiece** (``llama``: every piece of
``tokenizer.model`` with its score and type, then the tokenizer's added tokens; Llama 2, Mistral
v0.1-v0.3, Phi-3 mini, Gemma). llama.cpp merges SentencePiece pieces by their scores, which only
``tokenizer.model`` holds: without it such a vocabulary is refused, never written as byte-level BPE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_PRE = {("llama", 49152): "smollm", ("llama", 128256): "llama-bpe", ("qwen2", 151936): "qwen2"}
"""llama.cpp's pre-tokenizer names for known byte-level vocabularies (``tokenizer_pre`` names any other)."""
SENTENCEPIECE_MODEL = "tokenizer.model"
WORD_START = "\u2581"
"""SentencePiece's word-start mark ``▁``."""


def tokenizer_model(tokenizer: Any) -> dict[str, Any]:
    """The ``model`` section of the tokenizer's ``tokenizer.json``."""
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]


def is_sentencepiece(tokenizer: Any) -> bool:
    """A SentencePiece BPE vocabulary (BPE with byte fallback) rather than byte-level BPE."""
    return bool(tokenizer_model(tokenizer).get("byte_fallback"))


def sentencepiece_file(tokenizer: Any, folders: tuple[str | Path, ...] = ()) -> Path:
    """The ``tokenizer.model`` behind ``tokenizer``: in ``folders`` (the base model's), the folder the
    tokenizer was loaded from, or its ``vocab_file``.

    Raises:
        ValueError: when none holds it (the pieces' scores are only there).
    """
    candidates = [Path(folder) / SENTENCEPIECE_MODEL for folder in folders]
    candidates.append(Path(tokenizer.name_or_path) / SENTENCEPIECE_MODEL)
    if getattr(tokenizer, "vocab_file", None):
        candidates.append(Path(tokenizer.vocab_file))
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        raise ValueError(
            "the tokenizer is a SentencePiece vocabulary, which llama.cpp stores with each piece's score "
            f"from {SENTENCEPIECE_MODEL}; none was found (looked in {', '.join(map(str, candidates))}): "
            "put the base model's tokenizer.model beside its tokenizer.json"
        )
    return found


def looks_special(text: str) -> bool:
    """llama.cpp's ``does_token_look_special``: an added token the converter types control even when
    the tokenizer does not mark it special (``<|...|>``, ``<｜...｜>``, ``<unused...>``, Gemma's
    ``<mask>``)."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _added_token_text(content: str, special: bool, plain: bool) -> tuple[str, int]:
    """An added token's text and GGUF type, as the converter writes them: control, text unchanged,
    when marked special or when it :func:`looks_special`; any other user-defined with ``▁`` written
    as a space. ``plain`` (Phi-3's SentencePiece path): control or user-defined as marked, text
    unchanged."""
    import gguf

    if plain:
        return content, int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    if special or looks_special(content):
        return content, int(gguf.TokenType.CONTROL)
    return content.replace(WORD_START, " "), int(gguf.TokenType.USER_DEFINED)


def sentencepiece_vocabulary(
    model_file: Path, tokenizer: Any, vocab_size: int, plain_added: bool = False
) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types, one per embedding row: the pieces of ``model_file`` (rows past them
    ``[PADi]``), then the tokenizer's added tokens over them with score -1000.

    Raises:
        ValueError: when ``model_file`` is not the tokenizer's vocabulary.
    """
    import gguf
    from sentencepiece import SentencePieceProcessor

    pieces = SentencePieceProcessor(model_file=str(model_file))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    vocab = tokenizer.get_vocab()
    for i in range(min(pieces.vocab_size(), vocab_size)):
        piece = pieces.IdToPiece(i)
        if vocab.get(piece, i) != i:
            raise ValueError(
                f"{model_file} is not this tokenizer's vocabulary: its piece {i} {piece!r} is token "
                f"{vocab[piece]} in the tokenizer"
            )
        kind = gguf.TokenType.NORMAL
        if pieces.IsUnknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif pieces.IsControl(i):
            kind = gguf.TokenType.CONTROL
        elif pieces.IsUnused(i):
            kind = gguf.TokenType.UNUSED
        elif pieces.IsByte(i):
            kind = gguf.TokenType.BYTE
        tokens[i], scores[i], types[i] = piece, pieces.GetScore(i), int(kind)
    for i, added in sorted(tokenizer.added_tokens_decoder.items()):
        if i < vocab_size:
            tokens[i], types[i] = _added_token_text(added.content, added.special, plain_added)
            scores[i] = -1000.0
    return tokens, scores, types


def add_space_prefix(model_file: Path) -> bool:
    """Whether SentencePiece puts ``▁`` before the text (its normalizer's ``add_dummy_prefix``).

    Raises:
        ValueError: for a Unigram model (llama.cpp merges pieces by score, as BPE does).
    """
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(model_file.read_bytes())
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        kind = proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type)
        raise ValueError(f"{model_file} is a SentencePiece {kind} model; GGUF export writes BPE ones")
    return bool(proto.normalizer_spec.add_dummy_prefix)


def byte_level_vocabulary(
    tokenizer: Any, model: dict[str, Any], vocab_size: int
) -> tuple[list[str], list[int], list[str]]:
    """Tokens, types and merges (``model``: the ``model`` section of the tokenizer's ``tokenizer.json``),
    as the converter's ``get_vocab_base`` writes them: an added token's text is what the tokenizer
    decodes it to when it is not normalized (byte-level ``Ġ`` a space), then typed by
    :func:`_added_token_text`; ids no token has are ``[PADi]``.

    Raises:
        ValueError: when the tokenizer has more tokens than the model has embedding rows.
    """
    import gguf

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(
            f"the tokenizer has token ids up to {max(vocab.values())} but the model has {vocab_size} "
            "embedding rows (llama.cpp's converter stops there too): resize the embeddings to the tokenizer"
        )
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # embedding rows past the vocabulary
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for i, text in {i: text for text, i in vocab.items()}.items():
        if text not in added:
            tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
            continue
        if not decoder[i].normalized:
            text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
        tokens[i], types[i] = _added_token_text(text, decoder[i].special, plain=False)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def write_vocabulary(
    writer: Any,
    tokenizer: Any,
    config: Any,
    *,
    pre: str | None = None,
    chat_template: str | None = None,
    add_bos: bool = False,
    plain_added: bool = False,
    sentencepiece: Path | None = None,
) -> None:
    """The tokenizer's keys: vocabulary, special token ids, ``add_bos_token`` (always when
    ``add_bos``, else when the tokenizer's config sets it) and the chat template. ``sentencepiece`` is
    the ``tokenizer.model`` of a SentencePiece vocabulary (found beside the tokenizer when left out).

    Raises:
        ValueError: for a vocabulary llama.cpp would tokenize differently (see the module's docstring).
    """
    model = tokenizer_model(tokenizer)  # serialised once: a large vocabulary takes a while
    if model.get("type") != "BPE":
        raise ValueError(f"GGUF export writes BPE tokenizers, not {model.get('type')!r}")
    sentencepiece_vocab = bool(model.get("byte_fallback"))  # as is_sentencepiece decides
    if sentencepiece_vocab:
        model_file = sentencepiece or sentencepiece_file(tokenizer)
        space_prefix = add_space_prefix(model_file)
        vocabulary = sentencepiece_vocabulary(model_file, tokenizer, config.vocab_size, plain_added)
        tokens, scores, types = vocabulary
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        if not space_prefix:
            writer.add_add_space_prefix(False)
    else:
        name = pre or TOKENIZER_PRE.get((config.model_type, config.vocab_size))
        if name is None:
            raise ValueError(
                f"unknown pre-tokenizer for a {config.model_type} vocabulary of {config.vocab_size}: pass "
                "tokenizer_pre (llama.cpp's name for it, e.g. llama-bpe, qwen2, smollm)"
            )
        tokens, byte_types, merges = byte_level_vocabulary(tokenizer, model, config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(name)
        writer.add_token_list(tokens)
        writer.add_token_types(byte_types)
        writer.add_token_merges(merges)
    for key in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):  # the tokenizer's, else the model's
        value = getattr(tokenizer, f"{key}_token_id", None)
        if value is None and isinstance(getattr(config, f"{key}_token_id", None), int):
            value = getattr(config, f"{key}_token_id")
        if value is not None and value < config.vocab_size:
            getattr(writer, f"add_{key}_token_id")(value)
    if sentencepiece_vocab:  # what encoding a text adds, as llama.cpp's tokenizer will
        ids = tokenizer("a").input_ids
        writer.add_add_bos_token(ids[0] == tokenizer.bos_token_id)
        writer.add_add_eos_token(ids[-1] == tokenizer.eos_token_id)
        writer.add_add_sep_token(False)  # a separator between a pair's texts: rerankers only
    elif add_bos or "add_bos_token" in getattr(tokenizer, "init_kwargs", {}):
        writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    template = chat_template or tokenizer.chat_template
    if template:
        writer.add_chat_template(template)
