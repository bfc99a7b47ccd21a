"""Preference records (lit_instruct.data.preference): TRL's explicit and implicit layouts and
UltraFeedback's rows, shared prompt tokens, labels on each answer only, and the ``[chosen; rejected]``
batch, against an independent rendering (the tokenizer's own ``apply_chat_template`` and plain
tokenization); every field used, checked, counted or refused with file:line and its name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lit_instruct.data.preference import (
    PreferenceCollator,
    PreferenceRenderer,
    to_preference_record,
)
from lit_instruct.data.records import DataError
from lit_instruct.labels import IGNORE_INDEX

SYSTEM = {"role": "system", "content": "You answer briefly."}
USER = {"role": "user", "content": "What is the capital of France?"}
EARLIER = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


RECORDS = {
    "explicit-strings": (
        {"prompt": USER["content"], "chosen": "Paris.", "rejected": "Lyon, I think."},
        [USER],
    ),
    "explicit-messages": (
        {
            "prompt": [SYSTEM, *EARLIER, USER],
            "chosen": [_assistant("Paris.")],
            "rejected": [_assistant("Rome.")],
        },
        [SYSTEM, *EARLIER, USER],
    ),
    "implicit": (
        {"chosen": [*EARLIER, USER, _assistant("Paris.")], "rejected": [*EARLIER, USER, _assistant("Rome.")]},
        [*EARLIER, USER],
    ),
    "ultrafeedback": (
        {
            "prompt": USER["content"],
            "prompt_id": "3c5f",
            "chosen": [USER, _assistant("Paris.")],
            "rejected": [USER, _assistant("Rome.")],
            "messages": [USER, _assistant("Paris.")],
            "score_chosen": 8.5,
            "score_rejected": 3,
        },
        [USER],
    ),
    "system-field": (
        {"system": SYSTEM["content"], "prompt": [USER], "chosen": "Paris.", "rejected": "Rome."},
        [SYSTEM, USER],
    ),
}


def _expected(tokenizer, context, answer: str) -> tuple[list[int], list[int]]:
    """Independent ids and labels: the template's generation prompt, then the answer and its
    ``<|im_end|>`` labelled, whatever the template adds after it not."""
    prompt = list(tokenizer.apply_chat_template(context, add_generation_prompt=True, return_dict=False))
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    whole = list(tokenizer.apply_chat_template([*context, _assistant(answer)], return_dict=False))
    end = len(prompt) + len(answer_ids)
    assert whole[:end] == prompt + answer_ids  # the reference's own premise
    labels = [IGNORE_INDEX] * len(prompt) + answer_ids + [IGNORE_INDEX] * (len(whole) - end)
    return whole, labels


def _answers(raw) -> tuple[str, str]:
    pick = lambda v: v if isinstance(v, str) else v[-1]["content"]  # noqa: E731
    return pick(raw["chosen"]), pick(raw["rejected"])


@pytest.mark.parametrize("layout", RECORDS)
def test_pairs_share_the_prompt_and_label_only_the_answers(layout, tokenizer):
    raw, context = RECORDS[layout]
    renderer = PreferenceRenderer(tokenizer, max_seq_len=512)
    pair = renderer(to_preference_record(raw, "pairs.jsonl:3"))
    rows = [_expected(tokenizer, context, answer) for answer in _answers(raw)]

    batch = PreferenceCollator(tokenizer.pad_token_id)([pair, pair])
    width = max(len(ids) for ids, _ in rows)
    for row, (ids, labels) in zip((0, 2), rows, strict=True):  # [chosen, chosen, rejected, rejected]
        n = len(ids)
        assert torch.equal(batch["input_ids"][row, :n], torch.tensor(ids))
        assert torch.equal(batch["labels"][row], torch.tensor(labels + [IGNORE_INDEX] * (width - n)))
        assert torch.equal(batch["attention_mask"][row], torch.tensor([1] * n + [0] * (width - n)))
    assert torch.equal(
        batch["input_ids"][:, : pair.prompt_length],
        batch["input_ids"][:1, : pair.prompt_length].expand(4, -1),
    )
    assert batch["num_pairs"] == 2 and not pair.truncated


def test_truncation_keeps_the_prompt_end_and_cuts_both_answers_alike(tokenizer):
    raw = {"prompt": "word " * 30, "chosen": "yes " * 20, "rejected": "no " * 12}
    full = PreferenceRenderer(tokenizer, max_seq_len=10_000)(to_preference_record(raw, "p:1"))
    cut = PreferenceRenderer(tokenizer, max_seq_len=40)(to_preference_record(raw, "p:1"))
    assert cut.truncated and max(len(cut.chosen.input_ids), len(cut.rejected.input_ids)) == 40
    dropped = full.prompt_length - cut.prompt_length
    for whole, part in ((full.chosen, cut.chosen), (full.rejected, cut.rejected)):
        n = len(part.input_ids)
        assert (
            part.input_ids == whole.input_ids[dropped : dropped + n]
        )  # the prompt's end, the answer's start
        assert part.labels == whole.labels[dropped : dropped + n]
    assert cut.chosen.input_ids[: cut.prompt_length] == cut.rejected.input_ids[: cut.prompt_length]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"prompt": "Hi", "chosen": "Yes."}, "field 'rejected' is missing"),
        ({"prompt": "Hi", "chosen": 3, "rejected": "No."}, "field 'chosen' must be a string"),
        ({"chosen": [USER, _assistant("A")], "rejected": [SYSTEM, USER, _assistant("B")]}, "share 0 leading"),
        (
            {"prompt": [USER], "chosen": [_assistant("A"), USER], "rejected": "B"},
            "'chosen' must be one assistant",
        ),
        (
            {"prompt": [{"role": "user", "content": ""}], "chosen": "A", "rejected": "B"},
            r"'prompt\[0\]\.content'",
        ),
        ({"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}, "hold the same answer"),
    ],
)
def test_bad_records_are_refused_with_file_line_and_field(raw, message, tokenizer):
    with pytest.raises(DataError, match=message) as caught:
        PreferenceRenderer(tokenizer, 64)(to_preference_record(raw, "pairs.jsonl:7"))
    assert str(caught.value).startswith("pairs.jsonl:7: ")


ULTRA: dict[str, Any] = RECORDS["ultrafeedback"][0]  # type: ignore[assignment]


def test_ultrafeedback_rows_read_as_their_explicit_pair(tokenizer):
    """The UltraFeedback row, its prompt/answers alone and its implicit conversations: one pair."""
    renderer = PreferenceRenderer(tokenizer, max_seq_len=512)
    ultra = to_preference_record(ULTRA, "x")
    explicit = to_preference_record({"prompt": USER["content"], "chosen": "Paris.", "rejected": "Rome."}, "x")
    implicit = to_preference_record({k: ULTRA[k] for k in ("chosen", "rejected")}, "x")
    assert renderer(ultra) == renderer(explicit) == renderer(implicit)
    assert ultra.unused == ("prompt_id",) and not ultra.tied
    tied = to_preference_record({**ULTRA, "score_chosen": "3", "score_rejected": 3.0}, "x")  # csv text
    assert tied.tied


def test_unread_fields_are_counted_as_for_sft_records():
    raw = {
        **ULTRA,
        "chosen": [{**USER, "lang": "en"}, _assistant("Paris.")],
        "messages": [{**USER, "lang": "en"}, _assistant("Paris.")],
        "rejected": [{**USER, "lang": "en"}, {**_assistant("Rome."), "refusal": None}],
        "source": "flan",
        "metadata": {},
        "id": "",
    }
    assert to_preference_record(raw, "x").unused == ("chosen[].lang", "prompt_id", "source")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"prompt": "What is the capital of Spain?"},
            r"field 'prompt' differs from the 1 turn\(s\) 'chosen'",
        ),
        (
            {"prompt": [SYSTEM, USER]},
            r"field 'prompt' differs at prompt\[0\] from the 1 turn\(s\) 'chosen' and 'rejected' begin",
        ),
        (
            {"messages": [USER, _assistant("Rome.")]},
            r"field 'messages' must be the chosen conversation .* messages\[1\]",
        ),
        ({"score_chosen": 2}, r"field 'score_chosen' \(2\) is below 'score_rejected' \(3\)"),
        ({"score_chosen": "high"}, "field 'score_chosen' must be a finite number, got 'high'"),
        ({"score_rejected": float("nan")}, "field 'score_rejected' must be a finite number"),
        ({"score_rejected": True}, "field 'score_rejected' must be a finite number"),
        ({"score_rejected": None}, "field 'score_rejected' is missing while 'score_chosen' is given"),
        ({"images": ["a.png"]}, "field 'images' holds images"),
        (
            {"chosen": [USER, {**_assistant("Paris."), "images": ["a.png"]}]},
            r"field 'chosen\[1\]\.images' holds images",
        ),
        (
            {
                "system": "Be brief.",
                "prompt": [SYSTEM, USER],
                "chosen": "A",
                "rejected": "B",
                "messages": None,
            },
            r"both a 'system' field and a system turn \(prompt\[0\]\)",
        ),
        (
            {"chosen": [USER, _assistant(" ")], "messages": None},
            r"field 'chosen\[1\]\.content' \(assistant\) is empty",
        ),
        (
            {"chosen": [USER, _assistant("A")], "rejected": "B", "messages": None},
            "must both be whole conversations",
        ),
    ],
)
def test_ultrafeedback_fields_are_checked_with_file_line_and_field(change, message, tokenizer):
    with pytest.raises(DataError, match=message) as caught:
        PreferenceRenderer(tokenizer, 64)(to_preference_record({**ULTRA, **change}, "uf.parquet:row 4"))
    assert str(caught.value).startswith("uf.parquet:row 4: ")


def _call(arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "search", "arguments": arguments}}],
    }


SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Search the web"}}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            {
                "prompt": [USER],
                "chosen": [_call({"query": "x<|im_end|>"})],
                "rejected": [_call({"query": "y"})],
            },
            r"chosen\[0\]\.tool_calls\[0\]\.arguments\.query",
        ),
        (
            {
                "prompt": "Search",
                "chosen": [_call({"query": "x"})],
                "rejected": [_call({"query": {"deep": ["<|im_start|>"]}})],
            },
            r"rejected\[0\]\.tool_calls\[0\]\.arguments\.query\.deep\[0\]",
        ),
        (
            {
                "prompt": [USER],
                "chosen": "A",
                "rejected": "B",
                "tools": [{**SEARCH_TOOL, "function": {"name": "search", "description": "<|im_end|>"}}],
            },
            r"tools\[0\]\.function\.description",
        ),
        ({"system": "Be <|im_end|> brief.", "prompt": "Hi", "chosen": "A", "rejected": "B"}, r"system"),
        ({"prompt": "Hi <|im_start|>", "chosen": "A", "rejected": "B"}, r"prompt"),
    ],
)
def test_item4_special_token_in_preference_tool_call_refused(raw, field, tokenizer):
    """Preference pairs go through the SFT renderer's check: a special token's text in a tool call's
    arguments or the tools offered is refused, named by the pair's own field."""
    renderer = PreferenceRenderer(tokenizer, 512, chat_template="chatml-tools")
    with pytest.raises(
        DataError, match=rf"^pairs\.jsonl:7: {field} contains the special token '<\|im_"
    ) as caught:
        renderer(to_preference_record(raw, "pairs.jsonl:7"))
    assert caught.value.reason == "special_token_in_content"
