"""Records -> token ids and labels: chat-template rendering, per-turn masking, truncation.

Masks come from the template's own renderings and the tokenizer's character offsets, never from
searching for marker strings. For each assistant turn ``i`` the template renders the conversation up
to the turn with the generation prompt (what the model is given at inference) and through the turn.
The answer starts where the two renderings part (so text a template adds after the generation
prompt, such as an opening ``<think>``, stays a prompt when the answer repeats it, and is learnt when
it does not) and ends with the first special token after it: the end-of-turn marker (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``...), which IS a label so that the model learns to stop,
even when the pad token equals it. Whatever the template puts after it (a newline, an EOS) is not.

A conversation is one sample when the whole rendering contains each turn's rendering up to that
end-of-turn token unchanged (the template is prefix-stable). Templates that rewrite earlier turns
(Qwen3 drops earlier reasoning, some move the system prompt to the last user turn) are not; with
``multi_turn: auto`` (the default) such a conversation becomes one sample per assistant turn, each
rendered exactly as the model sees it at that turn (counted as ``split_per_turn``); ``joint``
refuses it, ``per_turn`` splits every conversation.

Whether the template shows a field (a turn's text, reasoning, a tool call's name and argument names,
a tool's name) is told by rendering the record again with the field's value put between two
sentinels: letters and digits found nowhere in the template or the record, which escaping (``tojson``,
``| e``) leaves as they are. The field is shown where both sentinels are, never told by searching for
its text; a record with a field the template drops, even in part, is refused (``template_drops_field``).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from lit_instruct.data.records import DataError, Message, Record
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.templates import resolve_chat_template

MultiTurn = Literal["auto", "joint", "per_turn", "last"]
TrainOn = Literal["answers", "all"]
CUT_CHARS_PER_TOKEN = 8
"""A rendering of more than ``2 x (CUT_CHARS_PER_TOKEN x (max_seq_len + 1) + CUT_MARGIN_CHARS)``
characters is tokenized in growing prefixes, never whole (:meth:`ChatRenderer._encode`)."""
CUT_MARGIN_CHARS = 1024
WINDOW_CHARS = 256
"""Characters tokenized on each side of a special token's text found past the tokenized prefix."""


@dataclass(frozen=True)
class Sample:
    """A tokenized conversation: ``labels[p]`` is ``input_ids[p]`` on answer tokens, else -100.
    ``full_length``: its tokens before truncation; negative when the rendering was cut before it was
    tokenized (it has more than ``-full_length`` tokens, the rest never counted)."""

    input_ids: list[int]
    labels: list[int]
    source: str
    full_length: int = 0
    images: tuple[str, ...] = ()  # the references of the images it shows, in order

    @property
    def truncated(self) -> bool:
        """Whether the rendered conversation was longer than the sample kept."""
        return self.full_length < 0 or self.full_length > len(self.input_ids)

    @property
    def length_before_truncation(self) -> str:
        """``full_length`` as words: ``1234``, or ``more than 513`` for a rendering cut before it was
        tokenized."""
        return f"more than {-self.full_length}" if self.full_length < 0 else str(self.full_length)

    @property
    def num_targets(self) -> int:
        """Number of predicted positions that count in the loss (position 0 is never predicted)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass(frozen=True)
class Encoding:
    """A text's tokens and their character offsets; ``complete`` False: the text's first tokens only
    (exact: those of the whole text), more follow."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    complete: bool = True

    @property
    def full_length(self) -> int:
        """The token count, negative when more tokens follow (:attr:`Sample.full_length`)."""
        return len(self.ids) if self.complete else -len(self.ids)


def stable_tokens(shorter: Encoding, longer: Encoding, before: int) -> int:
    """How many leading tokens two prefixes of one text share (ids and offsets), all ending by
    character ``before``."""
    count = 0
    for a, b, offset, other in zip(shorter.ids, longer.ids, shorter.offsets, longer.offsets, strict=False):
        if a != b or offset != other or offset[1] > before:
            break
        count += 1
    return count


@dataclass(frozen=True)
class AnswerTurn:
    """An assistant turn rendered as the model sees it: ``text`` (the conversation through the turn),
    its tokens with their character offsets (``encoding``), and the ``[start, end)`` characters it
    must produce (the answer and its end-of-turn token); ``train`` False keeps it out of the loss."""

    text: str
    encoding: Encoding
    start: int
    end: int
    train: bool = True
    messages: int = 0  # how many of the record's messages ``text`` renders


def common_prefix_length(a: str, b: str, block: int = 1 << 16) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (blocks compared whole first)."""
    n = min(len(a), len(b))
    at = next((i for i in range(0, n, block) if a[i : i + block] != b[i : i + block]), n)
    return next((i for i in range(at, min(at + block, n)) if a[i] != b[i]), n)


def _refuse_dropped(record: Record, field: str, value: str, kind: str, where: str) -> None:
    shown = value if len(value) <= 40 else value[:37] + "..."
    raise DataError(
        record.source,
        f"{field}: the chat template does not show it ({shown!r} is not in its rendering of {where}), so "
        f"the model would be trained without it; set data.chat_template to one that renders {kind} "
        "(chatml-tools for ChatML models such as SmolLM2 and Qwen)",
        reason="template_drops_field",
    )


@dataclass(frozen=True)
class Probe:
    """A field whose value was put between two sentinels, ``head`` and ``tail``: its name
    (``messages[2].content``), its value and what it is (for the error)."""

    field: str
    value: str
    kind: str
    head: str
    tail: str


def sentinel_tag(record: Record, template: str) -> str:
    """Letters found nowhere in ``template`` or ``record`` (any case): sentinels are built from it."""
    text = (template + json.dumps([m.for_template() for m in record.messages]) + (record.tools or "")).lower()
    tag = "qzxlitfield"
    while tag in text:
        tag += "q"
    return tag


class Probes:
    """Sentinels around a record's field values, and the probes they stand for.

    A sentinel is ``{tag}{n}{tag}``: letters and digits, so escaping leaves it as it is, distinct,
    none inside another. The value stays between its two (the template sees the same kind of text,
    ``<think>`` tags and all): a template that shows only part of it (the text after ``</think>``,
    the first 100 characters) loses one of them.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.probes: list[Probe] = []

    def stand_in(self, field: str, value: str, kind: str) -> str:
        """``value`` between two fresh sentinels (unchanged when blank: there is nothing to show)."""
        if not value.strip():
            return value
        n = 2 * len(self.probes)
        head, tail = f"{self.tag}{n}{self.tag}", f"{self.tag}{n + 1}{self.tag}"
        self.probes.append(Probe(field, value.strip(), kind, head, tail))
        return head + value + tail

    def message(self, message: Message, field: str) -> Message:
        """``message`` with its content, reasoning, tool calls' names and argument names probed."""
        probed = len(self.probes)
        content = self.stand_in(f"{field}.content", message.content, "the turn's text")
        head = len(self.probes[probed].head) if len(self.probes) > probed else 0
        reasoning = message.reasoning and self.stand_in(
            f"{field}.reasoning_content", message.reasoning, "reasoning"
        )
        calls = json.loads(message.tool_calls) if message.tool_calls else None
        for k, call in enumerate(calls or []):
            function, where = call["function"], f"{field}.tool_calls[{k}]"
            function["name"] = self.stand_in(where, function["name"], "tool calls")
            arguments = function["arguments"].items()
            function["arguments"] = {
                self.stand_in(f"{where}.arguments", a, "tool calls"): v for a, v in arguments
            }
        tool_calls = json.dumps(calls, ensure_ascii=False) if calls is not None else None
        slots = tuple(slot + head for slot in message.image_slots)  # the images stay around the text
        return replace(
            message, content=content, reasoning=reasoning, tool_calls=tool_calls, image_slots=slots
        )

    def tools(self, tools: str | None) -> str | None:
        """The record's tools (JSON) with each tool's name probed."""
        if tools is None:
            return None
        listed = json.loads(tools)
        for k, tool in enumerate(listed):
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                function["name"] = self.stand_in(f"tools[{k}]", function["name"], "the tools offered")
        return json.dumps(listed, ensure_ascii=False)

    def refuse_unshown(self, record: Record, text: str, where: str, after: int = 0) -> None:
        """Refuse the record when a field's sentinels are not both in ``text`` (the probed rendering
        of ``where``), or only before character ``after`` (the answer's start)."""
        for probe in self.probes:
            for sentinel in (probe.head, probe.tail):
                found = text.rfind(sentinel)
                if found < 0 or found + len(sentinel) <= after:
                    _refuse_dropped(record, probe.field, probe.value, probe.kind, where)


_PLAIN_KEY = re.compile(r"[A-Za-z_][\w-]*")


def _key_path(path: str, key: str) -> str:
    """``path.key``, or ``path["key"]`` for a key that is not a plain name."""
    return f"{path}.{key}" if _PLAIN_KEY.fullmatch(key) else f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def json_texts(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string inside a JSON value, object keys included, with its path, in document order (no
    recursion: any depth)."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            for key in item:
                yield _key_path(where, key), key
            stack.extend(reversed([(_key_path(where, key), v) for key, v in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(f"{where}[{j}]", v) for j, v in enumerate(item)]))


def template_texts(record: Record) -> Iterator[tuple[str, str]]:
    """Every text of a chat record that reaches the template, with its field path: each turn's
    content, reasoning, name and tool call id, its tool calls' ids, names and arguments (names and
    values at any depth), and every string of the tools offered."""
    for i, message in enumerate(record.messages):
        where = f"messages[{i}]"
        yield f"{where}.content", message.content
        optional = (
            ("reasoning", message.reasoning),
            ("name", message.name),
            ("tool_call_id", message.tool_call_id),
        )
        yield from ((f"{where}.{field}", text) for field, text in optional if text is not None)
        for k, call in enumerate(json.loads(message.tool_calls) if message.tool_calls else []):
            if "id" in call:
                yield f"{where}.tool_calls[{k}].id", call["id"]
            yield f"{where}.tool_calls[{k}].name", call["function"]["name"]
            yield from json_texts(call["function"]["arguments"], f"{where}.tool_calls[{k}].arguments")
    if record.tools:
        yield from json_texts(json.loads(record.tools), "tools")


class ChatRenderer:
    """Render records with a tokenizer's chat template and label the assistant turns.

    Args:
        tokenizer: a fast ``transformers`` tokenizer (character offsets are needed).
        max_seq_len: samples are cut to this many tokens before masking is evaluated.
        chat_template: overrides the tokenizer's template (needed when it has none): Jinja, or a
            name from :data:`lit_instruct.templates.BUILTIN_TEMPLATES`.
        multi_turn: ``auto`` (one sample per conversation where the template is prefix-stable,
            else one per assistant turn), ``joint`` (always one; refuses unstable templates),
            ``per_turn`` (always one per assistant turn) or ``last`` (the last answer only,
            LLaMA-Factory's ``mask_history``: earlier answers are context).
        train_on: ``answers`` (the assistant turns) or ``all`` (every token: Axolotl's
            ``train_on_inputs``).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_seq_len: int,
        chat_template: str | None = None,
        multi_turn: MultiTurn = "auto",
        train_on: TrainOn = "answers",
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("lit-instruct needs a fast tokenizer (character offsets) to place masks exactly")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        if multi_turn not in ("auto", "joint", "per_turn", "last"):
            raise ValueError(f"multi_turn must be auto, joint, per_turn or last, got {multi_turn!r}")
        if train_on not in ("answers", "all"):
            raise ValueError(f"train_on must be answers or all, got {train_on!r}")
        self.train_on = train_on
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.multi_turn = multi_turn
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = set(tokenizer.all_special_ids) | {i for i, t in decoder.items() if t.special}
        names = sorted(set(tokenizer.convert_ids_to_tokens(sorted(self.special_ids))), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, names))) if names else None
        self.first_cut = CUT_CHARS_PER_TOKEN * (max_seq_len + 1) + CUT_MARGIN_CHARS
        if not self._special_tokens_found_as_written():
            self.first_cut = 1 << 62  # where an answer ends past the cut could not be found: no cut

    def _render(self, record: Record, count: int, add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        messages = [m.for_template() for m in record.messages[:count]]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=json.loads(record.tools) if record.tools else None,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as error:
            raise DataError(
                record.source, f"the chat template refused the conversation: {error}", reason="template_error"
            ) from error

    def _check_content(self, record: Record) -> None:
        """Refuse a record any of whose texts that reach the template holds a special token's text:
        tokenized, it would be the token itself (a turn closed or opened inside the text).

        Raises:
            DataError: (``special_token_in_content``) naming the field (``messages[2].tool_calls[0]
                .arguments.query``, ``tools[0].function.description``) and the token.
        """
        if self._special_text is None:
            return
        for field, text in template_texts(record):
            found = self._special_text.search(text)
            if found:
                raise DataError(
                    record.source,
                    f"{field} contains the special token {found.group()!r}, which would break the "
                    "template's turn structure",
                    reason="special_token_in_content",
                )

    def answer_turns(self, record: Record) -> list[AnswerTurn]:
        """Each assistant turn rendered against its own prefix, with the span it must produce."""
        self._check_content(record)
        tag = sentinel_tag(record, self.chat_template)
        turns, last = [], 0
        for i, message in enumerate(record.messages):
            if message.role != "assistant":
                continue
            if i == 0 or all(m.role == "system" for m in record.messages[:i]):
                raise DataError(
                    record.source,
                    f"messages[{i}] is an assistant turn with no user turn before it",
                    reason="no_user_turn",
                )
            through = self._render(record, i + 1)
            prefix = self._render(record, i, add_generation_prompt=True)
            start = common_prefix_length(prefix, through)
            self._check_context_before(record, i, start)
            encoding = self._encode(through)
            end = self._answer_end(through, encoding, start)
            self._check_answer_shown(record, i, prefix, tag)
            turns.append(AnswerTurn(through, encoding, start, end, message.train, i + 1))
            last = i
        if turns:
            self._check_context_shown(record, last, tag)
        return turns

    def _check_answer_shown(self, record: Record, i: int, prefix: str, tag: str) -> None:
        """Refuse answer ``i`` when the template does not show its content, reasoning or a tool call's
        name or argument names inside the answer (after ``prefix``, the rendering before it, which
        lacks turn ``i``: a tool's name in the system prompt is no call): it dropped a field."""
        probes = Probes(tag)
        messages = list(record.messages)
        messages[i] = probes.message(messages[i], f"messages[{i}]")
        if probes.probes:
            text = self._render(replace(record, messages=tuple(messages)), i + 1)
            probes.refuse_unshown(record, text, "the answer", after=common_prefix_length(prefix, text))

    def _check_context_shown(self, record: Record, last: int, tag: str) -> None:
        """Refuse the record when its rendering through its last answer (turn ``last``) lacks a
        context turn's text or a tool's name."""
        probes = Probes(tag)
        messages = tuple(
            m if m.role == "assistant" else probes.message(m, f"messages[{k}]")
            for k, m in enumerate(record.messages)
        )
        tools = probes.tools(record.tools)
        if probes.probes:
            text = self._render(replace(record, messages=messages, tools=tools), last + 1)
            probes.refuse_unshown(record, text, "the conversation")

    def _check_context_before(self, record: Record, i: int, start: int) -> None:
        """Refuse answer ``i`` when its span would start before the end of the message in front of
        it: the template renders the conversation differently once the answer follows (Mistral
        v0.3's moves the system prompt into the last user message only while that message is last),
        so where the generation prompt and the full rendering part ways is inside the user's text.

        Raises:
            DataError: (``template_moves_context``) naming the record and the turn.
        """
        before = record.messages[i - 1]
        cuts = [0, *before.image_slots, len(before.content)]  # its text between its images
        pieces = [before.content[a:b].strip() for a, b in itertools.pairwise(cuts)]
        previous = next((piece for piece in reversed(pieces) if piece), "")
        where = self._render(record, i).rfind(previous) if previous else -1
        if where >= 0 and where + len(previous) > start:
            raise DataError(
                record.source,
                f"messages[{i}]: the chat template renders the conversation before this answer "
                "differently once the answer follows it (it moves or drops a system prompt or an earlier "
                "message), so the answer's tokens cannot be told from the context's; set a chat_template "
                "that renders earlier turns the same way, or leave out the system prompt",
                reason="template_moves_context",
            )

    def _special_tokens_found_as_written(self) -> bool:
        """Whether every special token is matched in the text as written (not after the tokenizer's
        normalizer), so that its text found past a cut is where the token is."""
        if getattr(self.tokenizer.backend_tokenizer, "normalizer", None) is None:
            return True
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
        return not any(decoder[i].normalized for i in self.special_ids if i in decoder)

    def _tokenize(self, text: str, add_special_tokens: bool = False) -> Encoding:
        encoding = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return Encoding(encoding["input_ids"], encoding["offset_mapping"])

    def _encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """The tokens of ``text`` with their character offsets; of a text far longer than
        ``max_seq_len`` needs, only its first tokens (at least ``max_seq_len + 1``), so that memory
        stays bounded whatever a record holds.

        Prefixes of growing length (twice as long each time) are tokenized, and the leading tokens
        two consecutive prefixes share, ending in the first half of the shorter one, are kept: a
        token whose text lies that far before both cuts is not changed by them (a tokenizer splits
        on special tokens, pre-tokenizes into words and merges within them: only the last words
        before a cut can differ from the whole text's). A text that runs out first is tokenized
        whole, as one shorter than the first cut always is.
        """
        need, cut = self.max_seq_len + 1, self.first_cut
        if len(text) <= 2 * cut:
            return self._tokenize(text, add_special_tokens)
        shorter = self._tokenize(text[:cut], add_special_tokens)
        while 2 * cut < len(text):
            longer = self._tokenize(text[: 2 * cut], add_special_tokens)
            kept = stable_tokens(shorter, longer, cut // 2)
            if kept >= need:
                return Encoding(longer.ids[:kept], longer.offsets[:kept], complete=False)
            shorter, cut = longer, 2 * cut
        return self._tokenize(text, add_special_tokens)

    def _answer_end(self, text: str, encoding: Encoding, start: int) -> int:
        """Where the answer starting at character ``start`` of ``text`` ends: with the first special
        token at or after it (the end-of-turn marker), else at the end of the text."""
        ends = (
            e
            for t, (s, e) in zip(encoding.ids, encoding.offsets, strict=True)
            if s >= start and t in self.special_ids
        )
        found = next(ends, None)
        if found is not None or encoding.complete:
            return found if found is not None else len(text)
        return self._special_end_past(text, max(start, encoding.offsets[-1][1]), start)

    def _special_end_past(self, text: str, position: int, start: int) -> int:
        """The end of the first special token at or after ``position`` of ``text``, which was cut
        before it was tokenized: each place its text is written is tokenized with
        :data:`WINDOW_CHARS` around it, and the first that the tokenizer reads as a special token
        (starting at or after ``start``) is taken; none: the text's end."""
        for match in self._special_text.finditer(text, position) if self._special_text else ():
            left = max(0, match.start() - WINDOW_CHARS)
            window = self._tokenize(text[left : match.end() + WINDOW_CHARS])
            for token, (s, e) in zip(window.ids, window.offsets, strict=True):
                if token in self.special_ids and left + s <= match.start() < left + e and left + s >= start:
                    return left + e
        return len(text)

    def _sample(
        self, record: Record, text: str, encoding: Encoding, spans: list[tuple[int, int]], messages: int
    ) -> Sample:
        """Label the tokens of ``text`` (``encoding``: the rendering of the record's first ``messages``
        messages) starting inside ``spans``, truncate to ``max_seq_len``."""
        ids = encoding.ids
        labels = [IGNORE_INDEX] * len(ids)
        for k, (s, _) in enumerate(encoding.offsets):
            if any(start <= s < end for start, end in spans):
                labels[k] = ids[k]
        return Sample(
            ids[: self.max_seq_len], labels[: self.max_seq_len], record.source, encoding.full_length
        )

    def __call__(self, record: Record) -> Sample:
        """The whole conversation as one sample, every assistant turn labelled.

        Raises:
            DataError: (``template_not_prefix_stable``) when the template renders an earlier turn
                differently inside the whole conversation than as the model saw it at that turn.
        """
        return self._joint(record, self.answer_turns(record))

    def _joint(self, record: Record, turns: list[AnswerTurn]) -> Sample:
        text = self._render(record, len(record.messages))
        for turn in turns:
            if not text.startswith(turn.text[: turn.end]):
                raise DataError(
                    record.source,
                    "the chat template renders an earlier assistant turn differently inside the whole "
                    "conversation than as the model saw it at that turn; set data.multi_turn to auto "
                    "or per_turn (one sample per assistant turn)",
                    reason="template_not_prefix_stable",
                )
        last = turns[-1] if turns else None  # a prefix-stable template's last turn is the whole text
        encoding = last.encoding if last and last.text == text else self._encode(text)
        spans = [(t.start, t.end) for t in turns if t.train]
        return self._sample(record, text, encoding, spans, len(record.messages))

    def samples(self, record: Record) -> tuple[list[Sample], bool]:
        """The record's samples under ``multi_turn`` and ``train_on``, and whether it was split per
        turn."""
        if record.text is not None:
            return [self._text_sample(record)], False
        self._check_images(record)
        samples, split = self._answer_samples(record)
        if self.train_on == "all":
            samples = [replace(sample, labels=list(sample.input_ids)) for sample in samples]
        return samples, split

    def _check_images(self, record: Record) -> None:
        """A text-only renderer refuses a record that shows images (the model would learn answers
        about pictures it never saw)."""
        shown = next((i for i, m in enumerate(record.messages) if m.images), None)
        if shown is not None:
            raise DataError(
                record.source,
                f"messages[{shown}] shows an image but the model has no image processor (a text-only "
                "model): train a vision-language model (docs/images.md) or leave the images out",
                reason="images_need_vision_model",
            )

    def _answer_samples(self, record: Record) -> tuple[list[Sample], bool]:
        turns = self.answer_turns(record)
        if self.multi_turn == "last":  # earlier answers are context
            turns = [replace(turn, train=False) for turn in turns[:-1]] + turns[-1:]
        if self.multi_turn != "per_turn":
            try:
                return [self._joint(record, turns)], False
            except DataError as error:
                if self.multi_turn == "joint" or error.reason != "template_not_prefix_stable":
                    raise
        trained = [t for t in turns if t.train]  # a context-only answer is no sample of its own
        return [
            self._sample(record, t.text, t.encoding, [(t.start, t.end)], t.messages) for t in trained
        ], True

    def _text_sample(self, record: Record) -> Sample:
        """A plain-text record, language-model style: every token trained, EOS appended."""
        assert record.text is not None
        encoding = self._encode(record.text, add_special_tokens=True)
        ids = list(encoding.ids)
        eos = self.tokenizer.eos_token_id
        if encoding.complete and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        length = len(ids) if encoding.complete else encoding.full_length
        return Sample(ids[: self.max_seq_len], ids[: self.max_seq_len], record.source, length)
