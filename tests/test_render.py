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


# -- issue 49 item 10: a record far longer than max_seq_len is tokenized only as far as needed ------


def _long_text(rng, chars: int) -> str:
    """Text of about ``chars`` characters whose tokenization is hard to cut: words, runs of spaces,
    tabs and newlines, long runs of one letter, digits, punctuation, CJK, emoji, combining accents."""
    pieces = [
        lambda: " ".join(
            rng.choice(["the", "model", "tokens", "answer", "data"]) for _ in range(rng.randint(1, 20))
        ),
        lambda: " " * rng.randint(1, 300),
        lambda: rng.choice(["\n", "\t", "\r\n", "\n\n\n"]) * rng.randint(1, 40),
        lambda: rng.choice("aeoxz") * rng.randint(1, 2000),
        lambda: str(rng.randint(0, 10**30)),
        lambda: rng.choice(["=", "-", "!?", "...", "/*"]) * rng.randint(1, 200),
        lambda: "".join(chr(rng.randint(0x4E00, 0x4FFF)) for _ in range(rng.randint(1, 50))),
        lambda: "🙂🚀" * rng.randint(1, 30) + "e\u0301" * rng.randint(1, 10),
    ]
    out: list[str] = []
    while sum(map(len, out)) < chars:
        out.append(rng.choice(pieces)())
    return "".join(out)


def test_item10_a_huge_record_is_tokenized_only_as_far_as_max_seq_len_needs(tokenizer, monkeypatch) -> None:
    """A record hundreds of times longer than max_seq_len is cut before tokenizing (the tokenizer
    never sees more than a small multiple of max_seq_len characters, so memory is bounded), counted as
    truncated as before, and its kept tokens and labels are those of the whole rendering."""
    long = "lorem ipsum dolor " * 20_000  # 360,000 characters
    records = [
        record(("user", "Hi"), ("assistant", long)),  # the answer cut short
        record(("user", long), ("assistant", "ok")),  # the answer cut away entirely
        Record((), "test:1", text=long),  # plain text
    ]
    seen: list[int] = []
    call = type(tokenizer).__call__

    def spy(self, text, *args, **kwargs):
        seen.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    counts: Counter[str] = Counter()
    samples = build_samples(records, ChatRenderer(tokenizer, 256), counts, Rejects())
    assert max(seen) <= 32 * 256
    monkeypatch.undo()
    assert counts == Counter(
        truncated=3,
        dropped_no_response_after_truncation=1,
        samples=2,
        response_tokens=sum(s.num_targets for s in samples),
    )
    answer, text = samples
    ids, labels = expected(
        tokenizer,
        [(SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False), (long, True)],
    )
    assert answer.truncated and torch.equal(torch.tensor(answer.input_ids), ids[:256])
    assert torch.equal(torch.tensor(answer.labels), labels[:256])
    assert text.truncated and text.input_ids == text.labels == tokenizer(long)["input_ids"][:256]
    with pytest.raises(
        DataError, match=r"test:1: the sample has more than \d+ tokens, more than max_seq_len=256"
    ):
        build_samples(records[:1], ChatRenderer(tokenizer, 256), Counter(), Rejects(), on_long_sample="raise")


QWEN3_LIKE = (  # drops the reasoning of answers before the last user turn: not prefix-stable
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if loop.index0 < ns.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _item10_records(rng) -> list[Record]:
    """Records whose renderings run far past a small max_seq_len, in every place: the context, the
    answer, an earlier answer (its end-of-turn token far beyond the cut), plain text."""
    big, small = (lambda: _long_text(rng, rng.randint(4_000, 30_000))), (lambda: _long_text(rng, 30))
    return [
        record(("user", big()), ("assistant", small())),
        record(("user", small()), ("assistant", big())),
        record(("system", big()), ("user", small()), ("assistant", small())),
        record(
            ("user", small()),
            ("assistant", "<think>" + big() + "</think>" + small()),
            ("user", small()),
            ("assistant", big()),
        ),
        record(("user", small()), ("assistant", small()), ("user", big()), ("assistant", small())),
        Record((), "test:1", text=big()),
    ]


@pytest.mark.parametrize("family", ["smollm2", "llama", "gemma"])
def test_item10_the_bound_changes_no_id_or_label(tokenizer, tmp_path, monkeypatch, family) -> None:
    """Cut before tokenizing, every sample has the ids, labels and counts of the whole rendering
    tokenized (the renderer without the bound): byte-level BPE with a regex pre-tokenizer (SmolLM2),
    and SentencePiece BPE over whole turns (Llama 2 and Gemma styles), through a prefix-stable and a
    rewriting template, at several max_seq_len."""
    import random

    from lit_instruct.data import render
    from tests.sentencepiece_vocab import sentencepiece_tokenizer

    tok = tokenizer if family == "smollm2" else sentencepiece_tokenizer(family, tmp_path / family)
    templates = ["chatml", QWEN3_LIKE] if family == "smollm2" else ["alpaca"]
    rng = random.Random(0)
    records = [r for _ in range(3) for r in _item10_records(rng)]
    for template in templates:
        for max_seq_len in (16, 100, 333):
            bounded = ChatRenderer(tok, max_seq_len, template)
            with monkeypatch.context() as patch:
                patch.setattr(render, "CUT_CHARS_PER_TOKEN", 10**12)  # no bound: the whole text tokenized
                whole = ChatRenderer(tok, max_seq_len, template)
            assert whole.first_cut > 10**12 > bounded.first_cut
            counts: list[Counter[str]] = [Counter(), Counter()]
            got, want = (
                build_samples(records, r, c, Rejects("skip"))
                for r, c in zip((bounded, whole), counts, strict=True)
            )
            assert counts[0] == counts[1] and counts[0]["truncated"] >= len(records)
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(torch.tensor(a.input_ids), torch.tensor(b.input_ids))
                assert torch.equal(torch.tensor(a.labels), torch.tensor(b.labels))
                assert a.truncated == b.truncated and (
                    a.full_length == b.full_length or -a.full_length < b.full_length
                )
