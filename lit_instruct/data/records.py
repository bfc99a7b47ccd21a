"""One parsed record -> a typed conversation; every record remembers where it came from.

Five formats are understood, detected per record or set explicitly:

* alpaca: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional),
  "history": [[instruction, answer], ...] (optional)}``
* prompt/completion: ``{"prompt": str, "completion": str}``, or TRL's conversational form where
  both are message lists (the completion's answers are trained)
* text: ``{"text": str}``, language-model style: every token trained, EOS appended
* chat (OpenAI style): ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
  "tools": [...] (optional)}``; assistant turns may carry ``tool_calls`` (their content may then be
  empty) and ``reasoning_content`` (or ``thinking``); tool turns may carry ``tool_call_id`` and ``name``.
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt"|"tool", "value": str}, ...]}``, with
  LLaMA-Factory's ``function_call`` (an assistant tool call, its value the call's JSON) and
  ``observation`` (a tool result) turns.

A record's ``system`` field becomes its first turn. An assistant turn may carry ``"train": false``
or ``"weight": 0``: it stays in the context but out of the loss. Tool
results are context, never trained on; the assistant's tool-call text is. Field names can be mapped
from the user's with ``columns`` (``{"instruction": "question"}``). Errors name the record's location
and the field.

A field no format reads is counted (``unused_field_id``, ``unused_field_conversations[].name``); one
that holds what would be trained or shown to the model but cannot be honoured is refused: images, a
preference pair, or a ShareGPT turn's ``tool_calls`` or ``reasoning_content`` (the ``messages``
format carries those). A turn that mixes the two layouts (``from``/``value`` on a chat turn) is
counted when both say the same, refused when they do not.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from lit_instruct.data.strict_json import JSONProblem, StrictDecoder

RecordFormat = Literal["auto", "alpaca", "prompt_completion", "chat", "sharegpt", "text"]
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
}
"""ShareGPT's ``from`` values and the roles they are."""
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""Where assistant turns keep their reasoning; templates are given it under the first two names."""
PAIRS_HINT = (
    "SFT trains on demonstrations; preference pairs train with model.objective: dpo (configs/dpo.yaml)"
)


def is_labelled_answer(raw: Any) -> bool:
    """Whether a raw record is an answer labelled desirable or not (TRL's unpaired layout, KTO's):
    a ``completion`` with a true/false ``label``."""
    if not (isinstance(raw, dict) and "completion" in raw):
        return False
    label = raw.get("label")
    return isinstance(label, bool) or (isinstance(label, str) and label.strip().lower() in ("true", "false"))


def is_pair(raw: Any) -> bool:
    """Whether a raw record is a preference pair (it has a ``chosen`` answer), not a demonstration."""
    return isinstance(raw, dict) and "chosen" in raw


REFUSED_FIELDS = {
    "videos": "videos (text-only training)",
    "audios": "audio (text-only training)",
    "chosen": f"a preference pair ({PAIRS_HINT})",
    "rejected": f"a preference pair ({PAIRS_HINT})",
    "function_call": "OpenAI's legacy function_call (use tool_calls)",
    "functions": "OpenAI's legacy functions (use tools)",
}
"""Fields that mean something lit-instruct cannot honour: a record (or turn) carrying one is refused."""
TURN_REFUSED_FIELDS = {
    **REFUSED_FIELDS,
    "images": "images as a turn field (show each as an image part of the turn's content, or list them "
    "in the record's images field with an <image> in the text where each goes)",
}
"""What a turn cannot carry (a record's own ``images`` field is read: docs/images.md)."""


@dataclass(frozen=True)
class TurnLayout:
    """The fields one turn layout reads, those it refuses (what they hold, what to do instead), and
    the other layout's fields (``from``/``value`` on a chat turn): counted when they repeat what the
    turn says, refused when they say something else. Any other non-empty field is counted unused."""

    reads: frozenset[str]
    refused: dict[str, str]
    twins: dict[str, str]
    """The other layout's field -> the field of this one that says the same."""
    keep: str
    """What to do with a twin that disagrees."""


_USE_MESSAGES = "use the messages format, whose assistant turns carry it"
TURN_LAYOUTS = {
    "chat": TurnLayout(
        frozenset(
            {"role", "content", "train", "weight", "tool_calls", "tool_call_id", "name", *REASONING_KEYS}
        ),
        TURN_REFUSED_FIELDS,
        {"from": "role", "value": "content"},
        "a messages turn is role and content: keep those",
    ),
    "sharegpt": TurnLayout(
        frozenset({"from", "value", "train", "weight"}),
        {
            **TURN_REFUSED_FIELDS,
            "tool_calls": "tool calls, which a ShareGPT turn cannot carry (make the call a turn of its own, "
            f"from: function_call, or {_USE_MESSAGES})",
            "function_call": "a tool call, which a ShareGPT turn cannot carry as a field (make it a turn of "
            f"its own, from: function_call, or {_USE_MESSAGES})",
            **{
                key: f"reasoning, which a ShareGPT turn cannot carry ({_USE_MESSAGES} as reasoning_content)"
                for key in REASONING_KEYS
            },
        },
        {"role": "from", "content": "value"},
        "a conversations turn is from and value: keep those",
    ),
}
"""How each format's turns are read: chat (``messages``, and TRL's conversational ``prompt`` and
``completion``) and ShareGPT (``conversations``)."""


class DataError(ValueError):
    """A record that cannot be used, with its location (``file:line``) and the offending field."""

    def __init__(self, source: str, message: str, reason: str = "invalid") -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.message = message
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt intact when raised in a worker process
        return DataError, (self.source, self.message, self.reason)


@dataclass(frozen=True)
class Message:
    """One turn of a conversation (hashable: tool calls are kept as JSON text)."""

    role: str
    content: str
    train: bool = True  # an assistant turn with False is context only, not in the loss
    tool_calls: str | None = None  # JSON list of {"type": "function", "function": {name, arguments}}
    reasoning: str | None = None
    tool_call_id: str | None = None
    name: str | None = None
    images: tuple[str, ...] = ()  # references (lit_instruct.data.images), in the order they are shown
    image_slots: tuple[int, ...] = ()  # where each image sits in ``content`` (a character offset)

    def content_parts(self) -> list[dict[str, Any]]:
        """The content as transformers' multimodal parts: text and ``{"type": "image"}`` in order."""
        parts: list[dict[str, Any]] = []
        at = 0
        for slot in self.image_slots:
            if slot > at:
                parts.append({"type": "text", "text": self.content[at:slot]})
            parts.append({"type": "image"})
            at = slot
        if at < len(self.content) or not parts:
            parts.append({"type": "text", "text": self.content[at:]})
        return parts

    def for_template(self) -> dict[str, Any]:
        """The turn as chat templates read it (OpenAI / transformers message layout; a turn with
        images as a list of parts)."""
        content: Any = self.content_parts() if self.images else self.content
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls is not None:
            message["tool_calls"] = json.loads(self.tool_calls)
        if self.reasoning is not None:
            message["reasoning_content"] = message["thinking"] = self.reasoning
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class Record:
    """A conversation to train on, the tools offered to it (JSON), and where it was read from."""

    messages: tuple[Message, ...]
    source: str
    tools: str | None = None
    text: str | None = None  # a plain-text record (format ``text``): every token is trained
    unused: tuple[str, ...] = ()  # fields read but not used (``id``, ``messages[].foo``): counted

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two records the same conversation (for de-duplication)."""
        return (self.messages, self.tools, self.text)


def map_columns(raw: Any, columns: dict[str, str], source: str) -> Any:
    """Rename the user's fields to ours: ``columns`` maps our name to theirs."""
    if not columns or not isinstance(raw, dict):
        return raw
    mapped = dict(raw)
    for ours, theirs in columns.items():
        if theirs not in raw:
            raise DataError(
                source,
                f"column '{theirs}' (mapped to '{ours}' by columns) is missing; the record has {sorted(raw)}",
                "missing_field",
            )
        mapped[ours] = mapped.pop(theirs)
    return mapped


def _string_field(raw: dict[str, Any], key: str, source: str, optional: bool = False) -> str:
    if key not in raw or raw[key] is None:
        if optional:
            return ""
        raise DataError(source, f"field '{key}' is missing", reason="missing_field")
    value = raw[key]
    if not isinstance(value, str):
        raise DataError(source, f"field '{key}' must be a string, got {type(value).__name__}", "bad_type")
    return value


def _content(turn: dict[str, Any], key: str, where: str, source: str, optional: bool) -> str:
    """A turn's text; OpenAI's list of ``{"type": "text", "text": ...}`` parts is joined (image
    parts are taken out first by :func:`_with_image_parts`)."""
    value = turn.get(key)
    if isinstance(value, list):
        parts = []
        for k, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES and "reference" in part:
                continue
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise DataError(
                    source,
                    f"field '{where}.{key}[{k}]' is not a text or image part",
                    "bad_type",
                )
            parts.append(part["text"])
        return "".join(parts)
    return _string_field(turn, key, f"{source}: {where}", optional=optional)


IMAGE_PART_TYPES = ("image", "image_url")


def _with_image_parts(message: Message, turn: dict[str, Any], key: str) -> Message:
    """``message`` with the images of its content parts (references already, see
    :mod:`lit_instruct.data.images`), each at the offset of the text before it."""
    value = turn.get(key)
    if not isinstance(value, list) or not any(
        isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in value
    ):
        return message
    images, slots, at = [], [], 0
    for part in value:
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
            images.append(part["reference"])
            slots.append(at)
        elif isinstance(part, dict):
            at += len(part.get("text", ""))
    return replace(message, images=tuple(images), image_slots=tuple(slots))


def _json_value(value: Any, field: str, source: str) -> Any:
    """``value``, parsed when it is a JSON string (tables often keep nested data as text)."""
    if isinstance(value, str):
        try:
            return StrictDecoder().loads(value)
        except json.JSONDecodeError as err:
            raise DataError(source, f"field '{field}' is not valid JSON: {err.msg}", "bad_type") from err
        except JSONProblem as problem:
            raise DataError(source, f"field '{field}': {problem.message}", problem.reason) from problem
    return value


def _tool_calls(value: Any, field: str, source: str) -> str:
    """Tool calls in the layout chat templates expect (arguments as an object), as JSON."""
    calls = _json_value(value, field, source)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise DataError(source, f"field '{field}' must be a non-empty list of tool calls", "bad_type")
    normalized = []
    for k, call in enumerate(calls):
        where = f"{field}[{k}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(source, f"field '{where}' needs a function name (function.name)", "bad_type")
        arguments = _json_value(function.get("arguments", {}), f"{where}.function.arguments", source)
        if not isinstance(arguments, dict):
            raise DataError(source, f"field '{where}.function.arguments' must be an object", "bad_type")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
        if isinstance(call, dict) and call.get("id") is not None:
            entry["id"] = str(call["id"])
        normalized.append(entry)
    return json.dumps(normalized, ensure_ascii=False)  # key order kept: templates print it


def _tools(raw: dict[str, Any], source: str) -> str | None:
    """The record's tool definitions (a list of JSON schemas) as JSON."""
    tools = _json_value(raw.get("tools"), "tools", source)
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(source, "field 'tools' must be a list of tool definitions (objects)", "bad_type")
    return json.dumps(tools, ensure_ascii=False)


def _flag(turn: dict[str, Any], key: str, where: str, source: str) -> bool | None:
    """``train`` (true/false) or ``weight`` (OpenAI's and Axolotl's 0/1) as a bool; None if absent."""
    value = turn.get(key)
    if value is None:  # absent, or null where a table's schema gave every turn the column
        return None
    if key == "train" and isinstance(value, bool):
        return value
    if key == "weight" and not isinstance(value, bool) and isinstance(value, int | float) and value in (0, 1):
        return value == 1
    expected = "true or false" if key == "train" else "0 or 1"
    raise DataError(source, f"field '{where}.{key}' must be {expected}, got {value!r}", "bad_type")


def _train_flag(turn: dict[str, Any], role: str, where: str, source: str) -> bool:
    """Whether an assistant turn is trained on: ``train`` or ``weight``, default yes. Other turns
    are context; saying so (``train: false``, ``weight: 0``) is accepted, asking to train them is not."""
    train, weight = _flag(turn, "train", where, source), _flag(turn, "weight", where, source)
    if train is not None and weight is not None and train != weight:
        raise DataError(
            source,
            f"fields '{where}.train' and '{where}.weight' disagree ({train} vs {turn['weight']})",
            "bad_type",
        )
    flag = train if train is not None else weight
    if flag and role != "assistant":
        key = "train" if train is not None else "weight"
        raise DataError(
            source,
            f"field '{where}.{key}' asks to train on a {role} turn; only assistant turns are trained "
            "(the loss is on answers): remove it",
            "bad_role",
        )
    return role != "assistant" or flag is not False


def _optional_string(turn: dict[str, Any], key: str, where: str, source: str) -> str | None:
    return _string_field(turn, key, f"{source}: {where}") if turn.get(key) is not None else None


def _reasoning_key(turn: dict[str, Any], where: str, source: str) -> str | None:
    """The first of :data:`REASONING_KEYS` a turn sets; two that hold different reasoning are refused."""
    keys = [key for key in REASONING_KEYS if not is_empty(turn.get(key))]
    for other in keys[1:]:
        if turn[other] != turn[keys[0]]:
            raise DataError(
                source,
                f"fields '{where}.{keys[0]}' and '{where}.{other}' hold different reasoning: keep one",
                "bad_type",
            )
    return keys[0] if keys else None


def _chat_turn(turn: dict[str, Any], where: str, source: str) -> Message:
    role = _string_field(turn, "role", f"{source}: {where}")
    if role not in ROLES:
        raise DataError(source, f"field '{where}.role' is {role!r}; expected one of {ROLES}", "bad_role")
    calls = turn.get("tool_calls")
    if calls is not None and role != "assistant":
        raise DataError(
            source, f"field '{where}.tool_calls' is on a {role} turn (only answers call tools)", "bad_role"
        )
    tool_calls = _tool_calls(calls, f"{where}.tool_calls", source) if calls is not None else None
    reasoning_key = _reasoning_key(turn, where, source)
    reasoning = _optional_string(turn, reasoning_key, where, source) if reasoning_key else None
    if reasoning is not None and role != "assistant":
        raise DataError(source, f"field '{where}.{reasoning_key}' is on a {role} turn", "bad_role")
    content = _content(turn, "content", where, source, optional=tool_calls is not None)
    message = Message(
        role,
        content,
        _train_flag(turn, role, where, source),
        tool_calls,
        reasoning or None,
        _optional_string(turn, "tool_call_id", where, source),
        _optional_string(turn, "name", where, source),
    )
    return _with_image_parts(message, turn, "content")


def _sharegpt_turn(turn: dict[str, Any], where: str, source: str) -> Message:
    name = _string_field(turn, "from", f"{source}: {where}")
    if name not in SHAREGPT_ROLES:
        expected = tuple(SHAREGPT_ROLES)
        raise DataError(source, f"field '{where}.from' is {name!r}; expected one of {expected}", "bad_role")
    role = SHAREGPT_ROLES[name]
    value = _content(turn, "value", where, source, optional=False)
    train = _train_flag(turn, role, where, source)
    if name == "function_call":
        return Message(role, "", train, tool_calls=_tool_calls(value, f"{where}.value", source))
    return _with_image_parts(Message(role, value, train), turn, "value")


def _turns(raw: dict[str, Any], source: str, key: str) -> tuple[Message, ...]:
    """The turns of a chat (``messages``) or ShareGPT (``conversations``) record."""
    turns = _json_value(raw[key], key, source)  # a table column may keep the list as JSON text
    if not isinstance(turns, list) or not turns:
        raise DataError(source, f"field '{key}' must be a non-empty list", reason="bad_type")
    parse = _sharegpt_turn if key == "conversations" else _chat_turn
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            fields = "from and value" if key == "conversations" else "role and content"
            raise DataError(source, f"field '{where}' must be an object with {fields}", "bad_type")
        messages.append(parse(turn, where, source))
    return tuple(messages)


def _check_conversation(
    messages: tuple[Message, ...], source: str, field: str = "messages", text: str = "content"
) -> None:
    for i, message in enumerate(messages):
        if not message.content.strip() and message.tool_calls is None and not message.images:
            raise DataError(source, f"field '{field}[{i}].{text}' ({message.role}) is empty", "empty_content")
    if messages[-1].role != "assistant":
        last = len(messages) - 1
        raise DataError(
            source,
            f"the conversation ends with a {messages[-1].role} turn ({field}[{last}]); "
            "the last turn must be the assistant's answer",
            reason="no_final_answer",
        )


def _refuse_other_format(raw: dict[str, Any], fmt: str, source: str) -> None:
    """A record that lacks its format's fields: say what it looks like instead."""
    missing = [key for key in FORMATS[fmt].required if key not in raw]
    try:
        looks = detect_format(raw, source)
    except DataError:
        looks = None
    hint = f" (it looks like a {looks} record: set format: auto or {looks})" if looks else ""
    raise DataError(
        source,
        f"format is {fmt} but the record has no {', '.join(repr(k) for k in missing)}; its fields are "
        f"{sorted(raw)}{hint}",
        "missing_field",
    )


def _conversational_prompt_completion(raw: dict[str, Any], source: str) -> tuple[Message, ...]:
    """TRL's conversational prompt/completion: both are message lists; the completion's answers are
    trained, an answer inside the prompt is context."""
    prompt = _turns({"prompt": raw["prompt"]}, source, "prompt")
    completion = _turns({"completion": raw["completion"]}, source, "completion")
    context = tuple(replace(m, train=False) if m.role == "assistant" else m for m in prompt)
    return context + completion


def is_empty(value: Any) -> bool:
    """A table's empty column, an export's ``refusal: null``: nothing would be lost."""
    return value is None or value == [] or value == {} or value == ""


def _refuse_field(name: str, what: str, source: str) -> DataError:
    return DataError(source, f"field '{name}' holds {what}: refused", "unsupported_field")


def _twin_agrees(turn: dict[str, Any], name: str, twin: str) -> bool:
    """Whether the other layout's field ``name`` says what this layout's ``twin`` says (a role by the
    role it maps to: ``from: gpt`` is ``role: assistant``)."""
    ours, theirs = turn.get(twin), turn[name]
    if twin in ("role", "from"):
        ours, theirs = (SHAREGPT_ROLES.get(r, r) if isinstance(r, str) else r for r in (ours, theirs))
    return bool(ours == theirs)


def unused_turn_fields(turn: dict[str, Any], layout: TurnLayout, where: str, source: str) -> list[str]:
    """The non-empty fields of one turn that ``layout`` does not read; one it refuses, or a twin that
    disagrees with the turn, is an error naming ``where`` (``conversations[2]``)."""
    unused = []
    for name, value in turn.items():
        if name in layout.reads or is_empty(value):
            continue
        if name in layout.refused:
            raise _refuse_field(f"{where}.{name}", layout.refused[name], source)
        twin = layout.twins.get(name)
        if twin is not None and not _twin_agrees(turn, name, twin):
            raise DataError(
                source,
                f"field '{where}.{name}' differs from '{where}.{twin}' ({layout.keep}): refused",
                "unsupported_field",
            )
        unused.append(name)
    return unused


def _turn_lists(raw: dict[str, Any], fmt: str, source: str) -> list[tuple[str, Any, TurnLayout]]:
    """The record's turn lists (parsed when kept as JSON text), each with how its turns are read."""
    if fmt == "chat":
        return [("messages", _json_value(raw["messages"], "messages", source), TURN_LAYOUTS["chat"])]
    if fmt == "sharegpt":
        turns = _json_value(raw["conversations"], "conversations", source)
        return [("conversations", turns, TURN_LAYOUTS["sharegpt"])]
    if fmt == "prompt_completion":  # TRL's conversational form: both are chat turns
        return [(key, raw[key], TURN_LAYOUTS["chat"]) for key in ("prompt", "completion")]
    return []


def _unused_fields(raw: dict[str, Any], fmt: str, source: str) -> tuple[str, ...]:
    """The non-empty fields of the record and of its turns that ``fmt`` does not use (a turn's as
    ``messages[].foo``); a field in :data:`REFUSED_FIELDS`, or one a turn layout refuses, is an error."""
    used = FORMATS[fmt].fields
    unused = []
    for name, value in raw.items():
        if name in used or is_empty(value):
            continue
        if name in REFUSED_FIELDS:
            raise _refuse_field(name, REFUSED_FIELDS[name], source)
        if name == "label" and is_labelled_answer(raw):  # SFT would train the undesirable answers too
            why = "whether the answer is desirable (KTO's layout: train it with model.objective: kto)"
            raise _refuse_field(name, why, source)
        unused.append(name)
    for key, turns, layout in _turn_lists(raw, fmt, source):
        for i, turn in enumerate(turns if isinstance(turns, list) else []):
            if isinstance(turn, dict):
                unused += [
                    f"{key}[].{name}" for name in unused_turn_fields(turn, layout, f"{key}[{i}]", source)
                ]
    return tuple(sorted(set(unused)))


def _alpaca_history(raw: dict[str, Any], source: str) -> tuple[Message, ...]:
    """LLaMA-Factory's alpaca ``history``: earlier ``[instruction, response]`` pairs, trained on as
    every answer of a conversation is."""
    history = _json_value(raw.get("history"), "history", source)
    if history is None:
        return ()
    if not isinstance(history, list):
        raise DataError(source, "field 'history' must be a list of [instruction, response] pairs", "bad_type")
    turns: list[Message] = []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise DataError(
                source, f"field 'history[{i}]' must be an [instruction, response] pair", "bad_type"
            )
        turns += [Message("user", pair[0]), Message("assistant", pair[1])]
    return tuple(turns)


def _with_system(
    raw: dict[str, Any], messages: tuple[Message, ...], source: str, key: str
) -> tuple[Message, ...]:
    """The record's top-level ``system`` prompt (LLaMA-Factory's ShareGPT and alpaca field) as its
    first turn."""
    system = _string_field(raw, "system", source, optional=True)
    if not system:
        return messages
    if messages[0].role == "system":
        raise DataError(
            source, f"the record has both a 'system' field and a system turn ({key}[0]): keep one", "bad_role"
        )
    return (Message("system", system), *messages)


def _conversation(
    raw: dict[str, Any], messages: tuple[Message, ...], source: str, key: str, text: str
) -> tuple[Message, ...]:
    """The record's turns with its top-level ``system`` prompt, checked: no empty turn, and the last
    one the assistant's answer (``key``/``text``: the format's names, for the error messages)."""
    messages = _with_system(raw, messages, source, key)
    _check_conversation(messages, source, key, text)
    return messages


def _chat(raw: dict[str, Any], source: str) -> Record:
    messages = _conversation(raw, _turns(raw, source, "messages"), source, "messages", "content")
    return Record(messages, source, _tools(raw, source))


def _sharegpt(raw: dict[str, Any], source: str) -> Record:
    turns = _turns(raw, source, "conversations")
    return Record(_conversation(raw, turns, source, "conversations", "value"), source, _tools(raw, source))


def _alpaca(raw: dict[str, Any], source: str) -> Record:
    instruction = _string_field(raw, "instruction", source)
    extra = _string_field(raw, "input", source, optional=True)
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    answer = Message("assistant", _string_field(raw, "output", source))
    messages = (*_alpaca_history(raw, source), Message("user", prompt), answer)
    return Record(_conversation(raw, messages, source, "messages", "content"), source)


def _prompt_completion(raw: dict[str, Any], source: str) -> Record:
    if isinstance(raw["prompt"], list | tuple) or isinstance(raw["completion"], list | tuple):
        messages = _conversational_prompt_completion(raw, source)
    else:
        messages = (
            Message("user", _string_field(raw, "prompt", source)),
            Message("assistant", _string_field(raw, "completion", source)),
        )
    return Record(_conversation(raw, messages, source, "messages", "content"), source)


def _text(raw: dict[str, Any], source: str) -> Record:
    text = _string_field(raw, "text", source)
    if not text.strip():
        raise DataError(source, "field 'text' is empty", "empty_content")
    return Record((), source, text=text)


@dataclass(frozen=True)
class Format:
    """One record format: the keys that tell it (in table order), the fields it needs and uses, and
    how a record of it becomes a :class:`Record`."""

    label: str
    """How the unknown-format error names it."""
    detect: tuple[str, ...]
    required: tuple[str, ...]
    fields: frozenset[str]
    """The record fields it uses; any other is counted as unused (``unused_field_<name>``)."""
    parse: Callable[[dict[str, Any], str], Record]


FORMATS: dict[str, Format] = {
    "chat": Format(
        "'messages' (chat)", ("messages",), ("messages",), frozenset({"messages", "tools", "system"}), _chat
    ),
    "sharegpt": Format(
        "'conversations' (ShareGPT)",
        ("conversations",),
        ("conversations",),
        frozenset({"conversations", "tools", "system"}),
        _sharegpt,
    ),
    "alpaca": Format(
        "'instruction'+'output' (alpaca)",
        ("instruction",),
        ("instruction", "output"),
        frozenset({"instruction", "input", "output", "system", "history"}),
        _alpaca,
    ),
    "prompt_completion": Format(
        "'prompt'+'completion'",
        ("prompt", "completion"),
        ("prompt", "completion"),
        frozenset({"prompt", "completion", "system"}),
        _prompt_completion,
    ),
    "text": Format("'text'", ("text",), ("text",), frozenset({"text"}), _text),
}
"""Every record format, in the order :func:`detect_format` tries them."""


def detect_format(raw: dict[str, Any], source: str) -> RecordFormat:
    """Tell a record's format from its keys (the first format of :data:`FORMATS` whose keys it has)."""
    for name, fmt in FORMATS.items():
        if all(key in raw for key in fmt.detect):
            return name  # type: ignore[return-value]  # FORMATS' keys are RecordFormat's (tested)
    labels = [fmt.label for fmt in FORMATS.values()]
    pairs = f"; 'chosen'/'rejected' are a preference pair ({PAIRS_HINT})" if is_pair(raw) else ""
    raise DataError(
        source,
        f"record has keys {sorted(raw)}; expected {', '.join(labels[:-1])} or {labels[-1]} (map other "
        f"names with columns){pairs}",
        reason="unknown_format",
    )


def to_record(
    raw: Any,
    source: str,
    fmt: RecordFormat = "auto",
    columns: dict[str, str] | None = None,
    image_folder: Path | None = None,
) -> Record:
    """Turn one parsed JSON value (or table row) into a :class:`Record`, checking its fields
    (``image_folder``: where relative image paths are read from, the data file's folder)."""
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    raw = map_columns(raw, columns or {}, source)
    if fmt == "auto":
        fmt = detect_format(raw, source)
    elif not set(FORMATS[fmt].required) <= set(raw):
        _refuse_other_format(raw, fmt, source)
    from lit_instruct.data.images import with_image_references  # it reads DataError from here

    raw = with_image_references(raw, fmt, image_folder, source)
    unused = _unused_fields(raw, fmt, source)
    return replace(FORMATS[fmt].parse(raw, source), unused=unused)
