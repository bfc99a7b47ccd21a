"""Preference records -> chosen and rejected samples sharing their prompt's tokens, and their batches.

The layouts read (TRL's two, and UltraFeedback-binarised rows):

- explicit prompt: ``prompt``, ``chosen``, ``rejected``; each a string (the prompt a user turn, the
  answers assistant turns) or a list of chat messages (the answers' lists hold the answer turn);
- implicit prompt: ``chosen`` and ``rejected`` whole conversations (message lists) that share every
  turn but the last, which is each one's assistant answer;
- both (``HuggingFaceH4/ultrafeedback_binarized``): ``prompt`` given and ``chosen``/``rejected``
  whole conversations; the prompt must then be exactly the turns they share (a string: one user turn).

Every field is used, checked, counted or refused, as for SFT records
(:mod:`lit_instruct.data.records`):

- used: ``prompt``, ``chosen``, ``rejected``, ``system`` (a first system turn, as for SFT; with a
  system turn in the prompt as well it is refused) and ``tools`` (shown to both answers);
- checked: ``messages`` (UltraFeedback's copy of the chosen conversation) must be that
  conversation, else the pair is refused; ``score_chosen`` and ``score_rejected`` must both be
  finite numbers (numeric text from a csv too) or both absent, and a pair whose chosen answer
  scored below its rejected one is refused (``scores_reversed``: training would teach the worse
  answer); equal scores are kept and counted (``tied_scores``);
- counted: any other non-empty field (``prompt_id``, ``id``, ``source``; a turn's ``lang``) is
  counted per source as ``unused_field_<name>`` (``unused_field_chosen[].lang``) and reported at setup,
  as SFT data's are: never dropped unseen, map it with ``columns`` if it was meant;
- refused: the fields SFT refuses for what they would hold (``images``, ``videos``, ``audios``,
  OpenAI's legacy ``function_call`` / ``functions``), on the record or on a turn.

Each side becomes a chat record rendered by :class:`~lit_instruct.data.render.ChatRenderer` with
``multi_turn="last"``: earlier answers are context, the last answer (and its end-of-turn token) is
labelled. The two renderings must hold the same tokens before their answers (checked per record);
a record where they differ is refused naming its file, line and field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.records import (
    REFUSED_FIELDS,
    TURN_LAYOUTS,
    DataError,
    Record,
    is_empty,
    to_record,
    unused_turn_fields,
)
from lit_instruct.data.render import ChatRenderer, Sample
from lit_instruct.labels import IGNORE_INDEX

FIELDS = frozenset(
    {"prompt", "chosen", "rejected", "system", "tools", "messages", "score_chosen", "score_rejected"}
)
"""The record fields a preference pair reads; any other non-empty one is counted unused."""
REFUSED = {
    **{name: why for name, why in REFUSED_FIELDS.items() if name not in ("chosen", "rejected")},
    "images": "images (preference objectives train on text: the model would learn answers about pictures "
    "it never saw)",
    "image": "an image (preference objectives train on text: the model would learn answers about pictures "
    "it never saw)",
}
"""Record fields that refuse the pair: what they hold would be lost."""


TurnName = tuple[str, bool]
"""A turn as the user's field names it (``chosen[1]``, ``prompt``), and whether that field was a
string (one turn, whose text is the field itself)."""


@dataclass(frozen=True)
class PreferenceRecord:
    """The chosen and rejected conversations of one preference pair (same context, last answer differs);
    ``unused``: the fields counted unused; ``tied``: its scores are equal; ``turns``: each side's
    turns as the user's fields name them (for errors)."""

    chosen: Record
    rejected: Record
    source: str
    unused: tuple[str, ...] = ()
    tied: bool = False
    turns: tuple[tuple[TurnName, ...], tuple[TurnName, ...]] = ((), ())

    @property
    def prompt_key(self) -> tuple[Any, ...]:
        """What the two answers follow (the turns before the last, the tools): pairs with the same one
        share a prompt."""
        return (self.chosen.messages[:-1], self.chosen.tools)

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two pairs the same (duplicates): both conversations."""
        return (self.chosen.key, self.rejected.key)


@dataclass(frozen=True)
class Part:
    """Consecutive turns of a side's conversation, from the user's field ``field`` at ``offset``
    (``whole``: the field was a string, one turn)."""

    field: str
    turns: list[Any]
    offset: int = 0
    whole: bool = False

    def where(self, k: int) -> str:
        return self.field if self.whole else f"{self.field}[{self.offset + k}]"


def _messages(value: Any, field: str, role: str, source: str) -> Part:
    """A field as chat messages: a string is one ``role`` turn, a list is taken as it is."""
    if isinstance(value, str):
        return Part(field, [{"role": role, "content": value}], whole=True)
    if isinstance(value, list) and value:
        return Part(field, value)
    raise DataError(source, f"field '{field}' must be a string or a non-empty list of messages", "bad_type")


_INDEX = re.compile(r"messages\[(\d+)\](\.content)?")


def _turn_names(parts: list[Part]) -> tuple[TurnName, ...]:
    """The user's name of each turn of the concatenated parts."""
    return tuple((part.where(k), part.whole) for part in parts for k in range(len(part.turns)))


def user_fields(message: str, turns: Sequence[TurnName]) -> str:
    """``message`` with the concatenation's turn names (``messages[2].content``) as the user's
    (``chosen[1].content``, ``prompt`` for a string)."""

    def rename(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index >= len(turns):
            return match.group(0)
        name, whole = turns[index]
        return name + ("" if whole else match.group(2) or "")

    return _INDEX.sub(rename, message)


def _record(parts: list[Part], tools: Any, source: str) -> Record:
    """The chat record of the concatenated parts; errors name the user's field (``chosen[1].content``,
    ``prompt`` for a string) rather than the concatenation's (``messages[2].content``)."""
    raw: dict[str, Any] = {"messages": [m for part in parts for m in part.turns]}
    if not is_empty(tools):
        raw["tools"] = tools
    try:
        return to_record(raw, source, "chat")
    except DataError as error:
        raise DataError(source, user_fields(error.message, _turn_names(parts)), error.reason) from error


def _plain(message: Any) -> Any:
    """What a message says: the fields a chat turn reads, empty ones left out (a table's struct
    columns give every turn every key); others (``lang``) are counted, not compared."""
    if not isinstance(message, dict):
        return message
    reads = TURN_LAYOUTS["chat"].reads
    return {key: value for key, value in message.items() if key in reads and not is_empty(value)}


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(_plain(x) == _plain(y) for x, y in zip(a, b, strict=True))


def _shared_prefix(chosen: list[Any], rejected: list[Any]) -> int:
    """How many leading messages the two conversations share."""
    count = 0
    for a, b in zip(chosen, rejected, strict=False):
        if _plain(a) != _plain(b):
            break
        count += 1
    return count


def _is_conversation(value: Any) -> bool:
    """Whether an answer field holds a whole conversation (its first turn not the answer's) rather than
    the answer turn alone."""
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    return not (isinstance(first, dict) and first.get("role") == "assistant")


def _implicit(raw: dict[str, Any], source: str) -> tuple[Part, Part, Part]:
    """The shared turns and the two answers of whole ``chosen``/``rejected`` conversations."""
    if not (isinstance(raw["chosen"], list) and isinstance(raw["rejected"], list)):
        why = (
            "without 'prompt', 'chosen' and 'rejected' must be whole conversations (message lists)"
            if raw.get("prompt") is None
            else "fields 'chosen' and 'rejected' must both be whole conversations (message lists) or both "
            "the answers alone"
        )
        raise DataError(source, why, "bad_type")
    chosen, rejected = raw["chosen"], raw["rejected"]
    shared = _shared_prefix(chosen, rejected)
    if shared == 0 or shared != len(chosen) - 1 or shared != len(rejected) - 1:
        raise DataError(
            source,
            f"fields 'chosen' and 'rejected' share {shared} leading messages; an implicit prompt needs "
            f"them to differ in their last message only (chosen has {len(chosen)}, "
            f"rejected {len(rejected)})",
            "bad_pair",
        )
    return (
        Part("chosen", chosen[:shared]),
        Part("chosen", chosen[shared:], shared),
        Part("rejected", rejected[shared:], shared),
    )


def _check_prompt(prompt: Part, shared: Part, source: str) -> None:
    """An explicit ``prompt`` beside whole conversations must be exactly the turns they share."""
    if _same(prompt.turns, shared.turns):
        return
    k = _shared_prefix(prompt.turns, shared.turns)
    at = f" at {prompt.where(k)}" if k < len(prompt.turns) else f" after its {len(prompt.turns)} turn(s)"
    at = "" if prompt.whole else at
    n = len(shared.turns)
    raise DataError(
        source,
        f"field 'prompt' differs{at} from the {n} turn(s) 'chosen' and 'rejected' "
        f"begin with (chosen[0:{n}]); with whole conversations, the prompt must be "
        "exactly those turns",
        "bad_pair",
    )


def _system(raw: dict[str, Any], prompt: Part, source: str) -> list[Part]:
    """The record's ``system`` field as a first part (none when empty)."""
    system = raw.get("system")
    if is_empty(system):
        return []
    if not isinstance(system, str):
        raise DataError(source, f"field 'system' must be a string, got {type(system).__name__}", "bad_type")
    first = prompt.turns[0]
    if isinstance(first, dict) and first.get("role") == "system":
        raise DataError(
            source,
            f"the record has both a 'system' field and a system turn ({prompt.where(0)}): keep one",
            "bad_role",
        )
    return [Part("system", [{"role": "system", "content": system}], whole=True)]


def _score(raw: dict[str, Any], field: str, source: str) -> float | None:
    """A score as a finite number (numeric text too: csv cells are text); None when absent."""
    value = raw.get(field)
    if is_empty(value):
        return None
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise DataError(source, f"field '{field}' must be a finite number, got {value!r}", "bad_type")
    return number


def _scores_tied(raw: dict[str, Any], source: str) -> bool:
    """Check ``score_chosen``/``score_rejected``: both or neither, the chosen not below the rejected;
    whether they are equal."""
    chosen, rejected = _score(raw, "score_chosen", source), _score(raw, "score_rejected", source)
    if (chosen is None) != (rejected is None):
        given, missing = (
            ("score_chosen", "score_rejected") if rejected is None else ("score_rejected", "score_chosen")
        )
        raise DataError(
            source, f"field '{missing}' is missing while '{given}' is given: give both or neither", "bad_pair"
        )
    if chosen is None or rejected is None:
        return False
    if chosen < rejected:
        raise DataError(
            source,
            f"field 'score_chosen' ({chosen:g}) is below 'score_rejected' ({rejected:g}): the chosen answer "
            "scored worse, training would prefer the worse answer (swap the answers or drop the pair)",
            "scores_reversed",
        )
    return chosen == rejected


def _check_messages(raw: dict[str, Any], prompt: Part, chosen: Part, source: str) -> None:
    """UltraFeedback's ``messages`` must be the chosen conversation (it repeats it)."""
    messages = raw.get("messages")
    if is_empty(messages):
        return
    conversation = prompt.turns + chosen.turns
    if not isinstance(messages, list) or not _same(messages, conversation):
        k = _shared_prefix(messages, conversation) if isinstance(messages, list) else 0
        raise DataError(
            source,
            f"field 'messages' must be the chosen conversation ({len(conversation)} turns: the prompt and "
            f"the chosen answer), as UltraFeedback's repeats it; it differs at messages[{k}]",
            "bad_pair",
        )


def _unused(
    raw: dict[str, Any], parts: list[Part], source: str, fields: frozenset[str] = FIELDS
) -> tuple[str, ...]:
    """The non-empty fields no part of the record reads (``fields``: those it reads), the record's
    and its turns' (``chosen[].lang``); a refused one raises."""
    unused = set()
    for name, value in raw.items():
        if name in fields or is_empty(value):
            continue
        if name in REFUSED:
            raise DataError(source, f"field '{name}' holds {REFUSED[name]}: refused", "unsupported_field")
        unused.add(name)
    layout = TURN_LAYOUTS["chat"]
    for part in parts:
        for k, turn in enumerate(part.turns):
            if isinstance(turn, dict) and not part.whole:
                names = unused_turn_fields(turn, layout, part.where(k), source)
                unused.update(f"{part.field}[].{name}" for name in names)
    return tuple(sorted(unused))


def to_preference_record(raw: Any, source: str) -> PreferenceRecord:
    """One JSON object (or table row) in an explicit-, implicit-prompt or UltraFeedback layout, checked.

    Raises:
        DataError: for a missing, mistyped or refused field, answers that are not one assistant turn
            each, implicit conversations that do not share all but their last turn, a prompt that is
            not the turns they share, ``messages`` that is not the chosen conversation, reversed scores.
    """
    if not isinstance(raw, dict):
        raise DataError(source, f"record must be a JSON object, got {type(raw).__name__}", "bad_type")
    for field in ("chosen", "rejected"):
        if raw.get(field) is None:
            raise DataError(
                source,
                f"field '{field}' is missing (a preference pair needs both answers); the record has "
                f"{sorted(raw)} (map other names with columns)",
                "missing_field",
            )
    if _is_conversation(raw["chosen"]) or _is_conversation(raw["rejected"]) or raw.get("prompt") is None:
        prompt, chosen, rejected = _implicit(raw, source)
        if raw.get("prompt") is not None:
            _check_prompt(_messages(raw["prompt"], "prompt", "user", source), prompt, source)
    else:
        prompt = _messages(raw["prompt"], "prompt", "user", source)
        chosen = _messages(raw["chosen"], "chosen", "assistant", source)
        rejected = _messages(raw["rejected"], "rejected", "assistant", source)
    for side in (chosen, rejected):
        turn = side.turns[0]
        if len(side.turns) != 1 or not isinstance(turn, dict) or turn.get("role") != "assistant":
            raise DataError(source, f"field '{side.field}' must be one assistant turn", "bad_pair")
    if _same(chosen.turns, rejected.turns):
        raise DataError(
            source,
            "fields 'chosen' and 'rejected' hold the same answer: the pair teaches nothing (its DPO loss "
            "stays ln 2, its gradient 0)",
            "same_answers",
        )
    tied = _scores_tied(raw, source)
    _check_messages(raw, prompt, chosen, source)
    context = [*_system(raw, prompt, source), prompt]
    unused = _unused(raw, [prompt, chosen, rejected], source)
    return PreferenceRecord(
        _record([*context, chosen], raw.get("tools"), source),
        _record([*context, rejected], raw.get("tools"), source),
        source,
        unused,
        tied,
        (_turn_names([*context, chosen]), _turn_names([*context, rejected])),
    )


@dataclass(frozen=True)
class PreferencePair:
    """Tokenized chosen and rejected samples: the same ``prompt_length`` first tokens, labels only on
    each answer; ``truncated`` when the pair was cut to fit, ``shortest_cut_answer`` the fewest tokens
    an answer that lost its end kept (``None``: no answer lost its end); ``reference``: the reference model's
    summed log-probabilities of the chosen and rejected answer, once computed
    (:mod:`lit_instruct.data.reference_cache`)."""

    chosen: Sample
    rejected: Sample
    prompt_length: int
    truncated: bool = False
    reference: tuple[float, float] | None = None
    shortest_cut_answer: int | None = None

    def without_labels(self) -> PreferencePair:
        """The pair as a rank's padding repeat: nothing in it counts."""
        return replace(
            self,
            chosen=replace(self.chosen, labels=[IGNORE_INDEX] * len(self.chosen.labels)),
            rejected=replace(self.rejected, labels=[IGNORE_INDEX] * len(self.rejected.labels)),
            truncated=False,
        )


def _prompt_length(sample: Sample, field: str, source: str) -> int:
    """Tokens before the sample's first label (its answer)."""
    first = next((k for k, label in enumerate(sample.labels) if label != IGNORE_INDEX), None)
    if first is None:
        raise DataError(source, f"field '{field}': the answer has no tokens", "empty_content")
    return first


class PreferenceRenderer:
    """Render preference records into :class:`PreferencePair` with a :class:`ChatRenderer`'s masks.

    Args:
        tokenizer: a fast ``transformers`` tokenizer.
        max_seq_len: longest chosen or rejected sequence; over it, both answers are cut to the same
            budget (at least half of it) and the prompt keeps its end.
        chat_template: overrides the tokenizer's template, as for SFT.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template: str | None = None) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        # rendered whole (earlier answers as context), cut here so that both answers are cut alike
        self.renderer = ChatRenderer(tokenizer, 2**62, chat_template, multi_turn="last")
        self.max_seq_len = max_seq_len

    def _render(self, record: Record, turns: Sequence[TurnName]) -> Sample:
        """The last answer's sample (the only one trained); errors name the user's fields (``turns``)."""
        try:
            samples, _ = self.renderer.samples(record)
        except DataError as error:
            raise DataError(record.source, user_fields(error.message, turns), error.reason) from error
        return samples[-1]

    def __call__(self, record: PreferenceRecord) -> PreferencePair:
        """The pair, checked to share the prompt's tokens.

        Raises:
            DataError: (``prompt_tokens_differ``) when the chosen and rejected renderings differ before
                their answers (a template that renders the prompt differently per answer, or a merge
                of the prompt's last token with the answer's first).
        """
        chosen = self._render(record.chosen, record.turns[0])
        rejected = self._render(record.rejected, record.turns[1])
        prompt = _prompt_length(chosen, "chosen", record.source)
        if _prompt_length(rejected, "rejected", record.source) != prompt or (
            chosen.input_ids[:prompt] != rejected.input_ids[:prompt]
        ):
            raise DataError(
                record.source,
                "field 'rejected': its rendering differs from the chosen one's before the answer; the two "
                "answers must follow the same prompt tokens",
                "prompt_tokens_differ",
            )
        return self._truncate(chosen, rejected, prompt)

    def _truncate(self, chosen: Sample, rejected: Sample, prompt: int) -> PreferencePair:
        """Cut both answers to one budget and the prompt from its start, so both fit ``max_seq_len``."""
        limit = self.max_seq_len
        longest = max(len(chosen.input_ids), len(rejected.input_ids))
        if longest <= limit:
            return PreferencePair(chosen, rejected, prompt)
        answer_budget = max(limit - prompt, limit // 2)
        whole = [len(s.input_ids) - prompt for s in (chosen, rejected)]
        answers = [min(length, answer_budget) for length in whole]
        keep = limit - max(answers)  # the prompt's last ``keep`` tokens
        start = prompt - min(prompt, keep)

        def cut(sample: Sample, answer: int) -> Sample:
            end = prompt + answer
            return Sample(
                sample.input_ids[start:end], sample.labels[start:end], sample.source, len(sample.input_ids)
            )

        cut_answers = [kept for kept, length in zip(answers, whole, strict=True) if kept < length]
        return PreferencePair(
            cut(chosen, answers[0]),
            cut(rejected, answers[1]),
            prompt - start,
            truncated=True,
            shortest_cut_answer=min(cut_answers, default=None),
        )


class PreferenceCollator:
    """One right-padded batch of ``[chosen rows; rejected rows]`` (``num_pairs`` of each), with the
    SFT collator's counts, and ``reference_logps`` (``(2P,)`` fp64: the chosen, then the rejected)
    when every pair carries its reference log-probabilities."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad = PadCollator(pad_id, pad_to_multiple_of)

    def __call__(self, pairs: Sequence[PreferencePair]) -> dict[str, Any]:
        batch = self.pad([p.chosen for p in pairs] + [p.rejected for p in pairs])
        batch["num_pairs"] = len(pairs)
        batch["num_truncated_pairs"] = sum(p.truncated for p in pairs)
        if pairs and all(p.reference is not None for p in pairs):
            chosen, rejected = zip(*(p.reference for p in pairs), strict=True)
            batch["reference_logps"] = torch.tensor(chosen + rejected, dtype=torch.float64)
        return batch
