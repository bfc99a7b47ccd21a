"""Records -> token ids and labels: chat-template rendering, per-turn masking, truncation.

Masks come from token boundaries of the one rendered conversation, never from searching for marker
strings. For each assistant turn ``i`` the template is rendered twice more: the conversation up to the
turn with the generation prompt (where the answer starts) and the conversation through the turn (where
it ends). The full text is tokenized once with character offsets, and a token is a label when it starts
inside an answer span. Inside a span, tokens after the last special token (the end-of-turn marker, e.g.
the newline after ``<|im_end|>``) are left unlabelled; the end-of-turn token itself IS a label, so the
model learns to stop, even when the pad token equals it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_instruct.data.records import DataError, Record
from lit_instruct.labels import IGNORE_INDEX

ALPACA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
)
"""The built-in alpaca-style prompt template (``chat_template: alpaca``), for tokenizers without one."""


def resolve_chat_template(tokenizer: Any, override: str | None = None) -> str:
    """The template that renders conversations: ``override`` (a Jinja template, or ``"alpaca"`` for
    :data:`ALPACA_CHAT_TEMPLATE`), else the tokenizer's own.

    Training and generation both call this, so a model is prompted the way it was trained.

    Raises:
        ValueError: when the tokenizer has no chat template and none is given.
    """
    if override == "alpaca":
        return ALPACA_CHAT_TEMPLATE
    template = override or tokenizer.chat_template
    if not template:
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
            "data.chat_template to a Jinja chat template, or to 'alpaca' for the built-in alpaca prompt"
        )
    return template


@dataclass(frozen=True)
class Sample:
    """A tokenized conversation: ``labels[p]`` is ``input_ids[p]`` on answer tokens, else -100."""

    input_ids: list[int]
    labels: list[int]
    source: str
    full_length: int = 0  # tokens before truncation

    @property
    def truncated(self) -> bool:
        """Whether the rendered conversation was longer than the sample kept."""
        return self.full_length > len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Number of predicted positions that count in the loss (position 0 is never predicted)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


class ChatRenderer:
    """Render records with a tokenizer's chat template and label the assistant turns.

    Args:
        tokenizer: a fast ``transformers`` tokenizer (character offsets are needed).
        max_seq_len: samples are cut to this many tokens before masking is evaluated.
        chat_template: overrides the tokenizer's template (needed when it has none); ``"alpaca"``
            selects :data:`ALPACA_CHAT_TEMPLATE`.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("lit-instruct needs a fast tokenizer (character offsets) to place masks exactly")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self._special_ids = set(tokenizer.all_special_ids)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def answer_spans(self, record: Record) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the ``[start, end)`` character span of each assistant turn."""
        messages = [{"role": m.role, "content": m.content} for m in record.messages]
        text = self._render(messages)
        spans = []
        for i, message in enumerate(record.messages):
            if message.role != "assistant":
                continue
            if i == 0 or all(m.role == "system" for m in record.messages[:i]):
                raise DataError(
                    record.source, f"messages[{i}] is an assistant turn with no user turn before it"
                )
            start = len(self._render(messages[:i], add_generation_prompt=True))
            through = self._render(messages[: i + 1])
            if not text.startswith(through) or not through.startswith(text[:start]):
                raise DataError(
                    record.source,
                    "the chat template renders a conversation's prefix differently from the whole "
                    "conversation, so turn boundaries cannot be found; set data.chat_template",
                    reason="template_not_prefix_stable",
                )
            spans.append((start, len(through)))
        return text, spans

    def __call__(self, record: Record) -> Sample:
        """Tokenize ``record``, label its assistant turns, then truncate to ``max_seq_len``."""
        text, spans = self.answer_spans(record)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = encoding["input_ids"]
        offsets: list[tuple[int, int]] = encoding["offset_mapping"]
        labels = [IGNORE_INDEX] * len(ids)
        for start, end in spans:
            inside = [k for k, (s, _) in enumerate(offsets) if start <= s < end]
            specials = [k for k in inside if ids[k] in self._special_ids]
            if specials:  # drop what follows the end-of-turn token (e.g. its newline)
                inside = [k for k in inside if k <= specials[-1]]
            for k in inside:
                labels[k] = ids[k]
        return Sample(ids[: self.max_seq_len], labels[: self.max_seq_len], record.source, len(ids))
