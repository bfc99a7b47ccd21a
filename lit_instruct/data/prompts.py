"""Prompts for online RL (GRPO, RLOO): records, rendered prompts and their batches.

The layout read is TRL's prompt-only one: ``prompt`` (a string, one user turn, or a list of chat
messages ending on a user or tool turn), with ``system`` and ``tools`` used as for pairs. Every
other field is a *column*: it reaches the reward functions as a keyword argument (``answer``:
``exact_answer``'s reference). Records with ``chosen``/``rejected`` or a ``completion`` are refused:
the policy writes its own answers here.

A prompt renders as the chat template renders a conversation awaiting the assistant's answer
(``add_generation_prompt``). Over ``max_seq_len`` it keeps its end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lit_instruct.data.preference import Part, _messages, _record, _system
from lit_instruct.data.records import DataError, Record
from lit_instruct.data.render import ChatRenderer, Sample
from lit_instruct.labels import IGNORE_INDEX

PROMPT_FIELDS = frozenset({"prompt", "system", "tools"})
ANSWER_FIELDS = ("chosen", "rejected", "completion")
"""Fields of pairs and labelled answers: offline data, refused for online RL."""


@dataclass(frozen=True)
class PromptRecord:
    """A prompt's turns, the record's other fields (``columns``) and where it was read."""

    record: Record
    columns: dict[str, Any]
    source: str

    @property
    def prompt_key(self) -> tuple[Any, ...]:
        """What the prompt asks (its turns, its tools): prompts held out whole."""
        return (self.record.messages, self.record.tools)

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two records the same (duplicates): the prompt and its columns."""
        return (self.record.key, json.dumps(self.columns, sort_keys=True, default=str))

    @property
    def unused(self) -> tuple[str, ...]:
        return ()


def to_prompt_record(raw: Any, source: str) -> PromptRecord:
    """A prompt-only record.

    Raises:
        DataError: a missing or mistyped ``prompt``, a prompt ending on an assistant turn, or the
            fields of pairs or labelled answers.
    """
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    offline = [name for name in ANSWER_FIELDS if name in raw]
    if offline:
        raise DataError(
            source,
            f"field '{offline[0]}' holds an answer: GRPO and RLOO sample their own answers to prompts (give "
            "prompt and the reward functions' columns, e.g. answer; train pairs with dpo, labelled "
            "answers with kto)",
            "bad_pair",
        )
    if raw.get("prompt") is None:
        raise DataError(
            source,
            f"field 'prompt' is missing (online RL reads prompt, plus columns for the rewards); the record "
            f"has {sorted(raw)} (map other names with columns)",
            "missing_field",
        )
    prompt = _messages(raw["prompt"], "prompt", "user", source)
    last = prompt.turns[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        raise DataError(
            source,
            f"{prompt.where(len(prompt.turns) - 1)}: the prompt ends on an assistant turn; the policy "
            "answers after the prompt's last user (or tool) turn",
            "bad_role",
        )
    parts: list[Part] = [*_system(raw, prompt, source), prompt]
    # the turns are checked as a conversation's (roles, contents, tool calls), with an answer to come
    awaited = Part("answer", [{"role": "assistant", "content": "(sampled)"}], whole=True)
    record = _record([*parts, awaited], raw.get("tools"), source)
    record = replace(record, messages=record.messages[:-1])
    shown = next((i for i, m in enumerate(record.messages) if m.images), None)
    if shown is not None:
        raise DataError(
            source,
            f"messages[{shown}] shows an image: online RL samples from text prompts only (the policy would "
            "answer without the image); leave the images out",
            "images_in_prompts",
        )
    columns = {name: value for name, value in raw.items() if name not in PROMPT_FIELDS}
    return PromptRecord(record, columns, source)


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its tokens (``sample``, no labels), its messages (what a reward receives
    as the prompt) and columns; ``truncated`` when it kept only its end."""

    sample: Sample
    messages: list[dict[str, Any]]
    columns: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    counted: bool = True
    """False for a rank's padding repeat: sampled like the others, it adds nothing."""

    def without_labels(self) -> Prompt:
        """The prompt as a rank's padding repeat."""
        return replace(self, counted=False, truncated=False)


class PromptRenderer:
    """Render prompt records awaiting the assistant's answer, cut to ``max_seq_len`` from the start."""

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template: str | None = None) -> None:
        self.renderer = ChatRenderer(tokenizer, max_seq_len, chat_template)
        self.max_seq_len = max_seq_len

    def __call__(self, record: PromptRecord) -> Prompt:
        renderer = self.renderer
        renderer._check_content(record.record)
        text = renderer._render(record.record, len(record.record.messages), add_generation_prompt=True)
        ids = renderer.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise DataError(record.source, "the prompt renders to no tokens", "empty_content")
        kept = ids[-self.max_seq_len :]
        sample = Sample(kept, [IGNORE_INDEX] * len(kept), record.source, len(ids))
        messages = [m.for_template() for m in record.record.messages]
        return Prompt(sample, messages, dict(record.columns), len(ids) > len(kept))


class PromptCollator:
    """A batch of prompts as lists (the sampler pads them): ``prompt_ids``, ``prompts`` (messages),
    ``columns`` (each field of any prompt, a list aligned with the prompts; ``None`` where a record
    lacks it), ``sources``, ``counted`` and ``num_prompts`` (those that count)."""

    def __call__(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        names = sorted({name for p in prompts for name in p.columns})
        return {
            "prompt_ids": [list(p.sample.input_ids) for p in prompts],
            "prompts": [p.messages for p in prompts],
            "columns": {name: [p.columns.get(name) for p in prompts] for name in names},
            "sources": [p.sample.source for p in prompts],
            "counted": [p.counted for p in prompts],
            "num_prompts": sum(p.counted for p in prompts),
        }
