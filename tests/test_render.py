"""Exact label masks: expected ids and labels are built piece by piece, independently of offsets."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from lit_instruct.data.collate import PadCollator
from lit_instruct.data.records import DataError, Message, Record
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.validation import Rejects, build_samples
from lit_instruct.labels import IGNORE_INDEX

SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


def expected(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels from (text, is_answer) pieces, each tokenized on its own."""
    ids, labels = [], []
    for text, is_answer in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if is_answer else [IGNORE_INDEX] * len(piece)
    return torch.tensor(ids), torch.tensor(labels)


def record(*turns: tuple[str, str]) -> Record:
    return Record(tuple(Message(role, content) for role, content in turns), "test:1")


def check(renderer: ChatRenderer, rec: Record, pieces: list[tuple[str, bool]]) -> None:
    sample = renderer(rec)
    ids, labels = expected(renderer.tokenizer, pieces)
    assert torch.equal(torch.tensor(sample.input_ids), ids)
    assert torch.equal(torch.tensor(sample.labels), labels)


def test_multi_turn_chat_with_system_labels_each_answer_and_its_end_of_turn(tokenizer) -> None:
    rec = record(
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello there"),
        ("user", "How are you?"),
        ("assistant", "Fine, thanks."),
    )
    check(
        ChatRenderer(tokenizer, 512),
        rec,
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("Hello there<|im_end|>", True),
            ("\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n", False),
            ("Fine, thanks.<|im_end|>", True),
            ("\n", False),
        ],
    )


def test_single_turn_gets_the_templates_default_system_prompt_masked(tokenizer) -> None:
    check(
        ChatRenderer(tokenizer, 512),
        record(("user", "Add 1 and 2"), ("assistant", "3")),
        [
            (SMOL_SYSTEM + "<|im_start|>user\nAdd 1 and 2<|im_end|>\n<|im_start|>assistant\n", False),
            ("3<|im_end|>", True),
            ("\n", False),
        ],
    )


def test_no_chat_template_is_an_error_unless_one_is_given(tokenizer) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template: set data\.chat_template"):
        ChatRenderer(bare, 512)
    check(
        ChatRenderer(bare, 512, chat_template="alpaca"),
        record(("user", "Say hi"), ("assistant", "Hi!")),
        [("### Instruction:\nSay hi\n\n### Response:\n", False), ("Hi!<|im_end|>", True), ("\n\n", False)],
    )


def test_response_cut_mid_way_keeps_the_answer_prefix_only(tokenizer) -> None:
    renderer = ChatRenderer(tokenizer, 512)
    rec = record(("user", "Count"), ("assistant", "one two three four five"))
    full = renderer(rec)
    first_answer = full.labels.index(next(label for label in full.labels if label != IGNORE_INDEX))
    cut = ChatRenderer(tokenizer, first_answer + 3)(rec)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[: first_answer + 3]
    assert cut.labels == full.labels[: first_answer + 3]
    assert cut.num_targets == 3


def test_long_samples_are_truncated_dropped_or_raise_and_counted(tokenizer) -> None:
    renderer = ChatRenderer(tokenizer, 40)
    records = [
        record(("user", "word " * 100), ("assistant", "ok")),  # the answer is cut away entirely
        record(("user", "Hi"), ("assistant", "Hello " * 30)),  # the answer is cut short
        record(("user", "Hi"), ("assistant", "Hello")),
    ]
    counts: Counter[str] = Counter()
    samples = build_samples(records, renderer, counts, Rejects(), on_long_sample="truncate")
    assert [len(s.input_ids) for s in samples] == [40, len(renderer(records[2]).input_ids)]
    assert counts == Counter(
        dropped_no_response_after_truncation=1,
        truncated=2,
        samples=2,
        response_tokens=sum(s.num_targets for s in samples),
    )

    counts = Counter()
    samples = build_samples(records, renderer, counts, Rejects(), on_long_sample="drop")
    assert [s.source for s in samples] == ["test:1"] and counts["dropped_too_long"] == 2

    with pytest.raises(DataError, match=r"test:1: the sample has \d+ tokens, more than max_seq_len=40"):
        build_samples(records, renderer, Counter(), Rejects(), on_long_sample="raise")


def test_assistant_turn_without_a_user_turn_is_an_error(tokenizer) -> None:
    with pytest.raises(DataError, match="test:1: messages\\[1\\] is an assistant turn with no user turn"):
        ChatRenderer(tokenizer, 512)(record(("system", "s"), ("assistant", "a")))


def test_padding_is_never_a_label_but_eos_is_even_when_pad_equals_eos(tokenizer) -> None:
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    renderer = ChatRenderer(tokenizer, 512)
    short, long = (
        renderer(record(("user", "Hi"), ("assistant", "Yo"))),
        renderer(record(("user", "Hi"), ("assistant", "Hello, how can I help you today?"))),
    )
    batch = PadCollator(tokenizer.pad_token_id)([short, long])
    n = len(short.input_ids)
    assert batch["input_ids"].shape == (2, len(long.input_ids))
    assert torch.equal(batch["attention_mask"][0], (torch.arange(len(long.input_ids)) < n).long())
    assert torch.all(batch["labels"][0, n:] == IGNORE_INDEX)
    assert batch["labels"][0, n - 2] == tokenizer.eos_token_id  # <|im_end|> then "\n"
    assert batch["labels"][0, n - 1] == IGNORE_INDEX


def test_an_answer_with_train_false_is_context_only(tokenizer) -> None:
    rec = Record(
        (
            Message("system", "Be brief."),
            Message("user", "Hi"),
            Message("assistant", "Hello there", train=False),
            Message("user", "How are you?"),
            Message("assistant", "Fine, thanks."),
        ),
        "test:1",
    )
    check(
        ChatRenderer(tokenizer, 512),
        rec,
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\nHello there<|im_end|>\n"
                "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("Fine, thanks.<|im_end|>", True),
            ("\n", False),
        ],
    )
    per_turn, split = ChatRenderer(tokenizer, 512, multi_turn="per_turn").samples(rec)
    assert split and len(per_turn) == 1  # the context-only answer makes no sample of its own
    assert torch.equal(
        torch.tensor(per_turn[0].labels),
        torch.tensor(ChatRenderer(tokenizer, 512)(rec).labels)[: len(per_turn[0].labels)],
    )
    silent = Record(rec.messages[:3], "test:2")
    counts = Counter()
    assert (
        build_samples([silent], ChatRenderer(tokenizer, 512), counts, Rejects(), on_long_sample="truncate")
        == []
    )
    assert counts["dropped_no_response_tokens"] == 1  # nothing to learn: dropped, and counted
