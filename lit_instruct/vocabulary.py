"""New tokens for a chat template the tokenizer lacks: a base model taught ChatML's ``<|im_start|>`` /
``<|im_end|>``, or any template's turn markers.

The data and the model add the same list, in the same order, to the same base tokenizer, so both see
the same ids (:func:`add_tokens`); the model then grows its embedding (and untied head) to hold them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

NewTokens = list[str] | Literal["auto"] | None
"""``data.new_tokens``: the tokens to add, ``auto`` (the template's markers the tokenizer lacks), or none."""

MARKER = re.compile(r"<\|[^|<>\s]{1,64}\|>|</?[A-Za-z_][\w-]{0,63}>")
"""A turn marker: ``<|im_start|>``, ``<|start_header_id|>``, ``<start_of_turn>``, ``<s>``."""
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Bye."},
    {"role": "assistant", "content": "Goodbye."},
]
"""A conversation of plain words: every marker in its rendering is the template's own."""


def is_one_token(tokenizer: Any, text: str) -> bool:
    """``text`` encodes to one token (without the tokenizer's own additions)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1


def template_markers(tokenizer: Any, template: str) -> list[str]:
    """The turn markers ``template`` renders around a plain conversation that ``tokenizer`` does not
    hold as single tokens, in the order they first appear (the conversation loses its system turn
    for a template that refuses one, as Gemma's does).

    Raises:
        ValueError: when the template renders neither conversation.
    """
    try:
        text = tokenizer.apply_chat_template(PROBE, chat_template=template, tokenize=False)
    except Exception:  # a template's raise_exception (no system role), or any Jinja error
        try:
            text = tokenizer.apply_chat_template(PROBE[1:], chat_template=template, tokenize=False)
        except Exception as error:
            raise ValueError(
                f"data.new_tokens: auto renders a plain conversation to find the chat template's markers, "
                f"but the template fails on it ({error}): set data.new_tokens to a list, or null"
            ) from error
    markers = dict.fromkeys(MARKER.findall(text))
    return [marker for marker in markers if not is_one_token(tokenizer, marker)]


def resolve_new_tokens(tokenizer: Any, templates: list[str], new_tokens: NewTokens) -> list[str]:
    """The tokens to add: ``new_tokens`` as given, or with ``auto`` the markers of ``templates`` the
    tokenizer lacks; none that it already holds as one token.

    Raises:
        ValueError: for an empty or whitespace-holding token.
    """
    if new_tokens is None:
        return []
    if new_tokens == "auto":
        found = [marker for template in templates for marker in template_markers(tokenizer, template)]
        return list(dict.fromkeys(found))
    for token in new_tokens:
        if not token or token != token.strip():
            raise ValueError(f"data.new_tokens: {token!r} is empty or has surrounding whitespace")
    return [token for token in dict.fromkeys(new_tokens) if not is_one_token(tokenizer, token)]


def add_tokens(tokenizer: Any, tokens: list[str]) -> list[int]:
    """Add ``tokens`` to ``tokenizer`` as special tokens (never split, kept whole when decoding);
    their ids, in order."""
    if tokens:
        tokenizer.add_tokens(tokens, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    return list(ids)


def base_tokenizer(model: str, new_tokens: list[str] | None = None) -> Any:
    """The tokenizer of ``model`` (bundled name, folder or hub id) with ``new_tokens`` added."""
    from transformers import AutoTokenizer

    from lit_instruct.model_names import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    add_tokens(tokenizer, new_tokens or [])
    return tokenizer


def adapter_tokenizer(adapter: str | Path | None, model: str) -> Any:
    """The tokenizer an adapter was trained with: the one saved in its folder (a vocabulary grown by
    new tokens), else its base model's."""
    from transformers import AutoTokenizer

    from lit_instruct.adapter_folder import has_tokenizer

    if has_tokenizer(adapter):
        return AutoTokenizer.from_pretrained(adapter)
    return base_tokenizer(model)


def adapter_new_tokens(adapter: str | Path, model: str) -> list[str]:
    """The tokens an adapter's training added to its base's vocabulary (none without a saved tokenizer)."""
    grown = adapter_tokenizer(adapter, model)
    first = len(base_tokenizer(model))
    return list(grown.convert_ids_to_tokens(list(range(first, len(grown)))))
