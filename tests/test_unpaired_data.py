"""Unpaired answers labelled desirable or not (KTO's data: lit_instruct.data.unpaired): TRL's layout and
pairs read as answers, errors naming file, line and field, the KL rows of a batch, and the settings
and objectives that cannot take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError
from lit_instruct.data.render import Sample
from lit_instruct.data.unpaired import UnpairedAnswer, UnpairedCollator, to_unpaired_records
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from tests.helpers import trainer

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "preference_sample.jsonl"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def answers_of(tiny_model_dir: Path, path: Path, **settings) -> InstructDataModule:
    data = InstructDataModule(
        batch_kind="unpaired",
        tokenizer=str(tiny_model_dir),
        train_files=[str(path)],
        val_fraction=0.0,
        batch_size=2,
        **settings,
    )
    data.setup("fit")
    return data


def test_trls_layout_strings_messages_and_csv_labels(tiny_model_dir, tmp_path) -> None:
    rows = [
        {"prompt": "Hi", "completion": "Hello!", "label": True},
        {
            "prompt": [{"role": "user", "content": "Sum?"}],
            "completion": [{"role": "assistant", "content": "No."}],
            "label": "false",
        },
        {"prompt": "Name a fruit.", "completion": "An apple.", "label": "TRUE", "id": 7},
    ]
    data = answers_of(tiny_model_dir, write(tmp_path / "a.jsonl", rows))
    answers = data.pairs("train")
    assert [a.desirable for a in answers] == [True, False, True]
    counts = data.counts["train"]
    assert (counts["answers"], counts["desirable"], counts["undesirable"], counts["unused_field_id"]) == (
        3,
        2,
        1,
        1,
    )
    tokenizer = data.load_tokenizer()
    first = answers[0].sample
    trained = [t for t, label in zip(first.input_ids, first.labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained).startswith("Hello!")  # the answer, not the prompt, is labelled
    assert all(label == IGNORE_INDEX for label in first.labels[: answers[0].prompt_length])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "Hi", "completion": "Hello!"}, "field 'label' is missing"),
        ({"prompt": "Hi", "completion": "Hello!", "label": "maybe"}, "field 'label' must be true"),
        ({"prompt": "Hi", "label": True}, "field 'completion' is missing"),
        (
            {"prompt": "Hi", "completion": [{"role": "user", "content": "x"}], "label": True},
            "one assistant turn",
        ),
    ],
)
def test_a_bad_record_names_its_line_and_field(row, message) -> None:
    with pytest.raises(DataError, match=rf"a\.jsonl:3: .*{message}"):
        to_unpaired_records(row, "a.jsonl:3")


def test_pairs_read_as_answers_chosen_first_and_kl_rows_mismatched(tiny_model_dir) -> None:
    """Each pair gives its chosen answer (desirable) in its place and its rejected one after all
    chosen ones (TRL's unpairing): the KL rows of held-out batches, which take the previous answer's
    completion, never pair a prompt with an answer to itself."""
    data = InstructDataModule(
        batch_kind="unpaired",
        tokenizer="smollm2-135m-instruct",
        train_files=[str(SAMPLE)],
        val_fraction=0.1,
        batch_size=8,
        max_seq_len=128,
    )
    data.setup("fit")
    pairs = len(SAMPLE.read_text().splitlines())
    assert data.counts["train"]["answers"] + data.counts["val"]["answers"] == 2 * pairs
    val = data.pairs("val")
    labels = [a.desirable for a in val]
    assert labels == sorted(labels, reverse=True)  # the chosen answers, then the rejected ones
    records = [a.sample.source for a in val]  # each answer's file:line (a pair gives two)
    start = 0
    for batch in data.val_dataloader():
        n = len(batch["desirable"])
        for row in range(n):
            prompt = batch["input_ids"][row][: int((batch["labels"][row] == IGNORE_INDEX).long().argmin())]
            kl = batch["input_ids"][n + row]
            assert torch.equal(kl[: len(prompt)], prompt)
            partner = (row - 1) % n
            if n > 1:
                assert records[start + partner] != records[start + row], "a KL row takes its pair's answer"
        start += n
    assert start == len(val)


def test_kl_rows_of_padding_repeats_and_lone_answers_do_not_count() -> None:
    def answer(ids: list[int], prompt: int, desirable: bool) -> UnpairedAnswer:
        return UnpairedAnswer(Sample(ids, [IGNORE_INDEX] * prompt + ids[prompt:], "s"), prompt, desirable)

    a, b, c = answer([1, 2, 3, 4], 2, True), answer([5, 6, 7], 1, False), answer([8, 9, 10, 11], 3, True)
    collate = UnpairedCollator(pad_id=0, max_seq_len=16)
    batch = collate([a, b.without_labels(), c])
    assert batch["answer_mask"].tolist() == [True, False, True]
    assert batch["kl_mask"].tolist() == [True, False, False]  # c's KL row holds the repeat's completion
    assert batch["input_ids"][3].tolist()[:4] == [1, 2, 11, 0]  # a's prompt, c's completion
    assert collate([a])["kl_mask"].tolist() == [False]  # alone: its KL row would be itself


def test_the_sft_reader_refuses_labelled_answers(tiny_model_dir, tmp_path) -> None:
    path = write(tmp_path / "kto.jsonl", [{"prompt": "Hi", "completion": "Go away.", "label": False}])
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(path)], cache=False)
    with pytest.raises(
        DataError,
        match=r"kto\.jsonl:1: field 'label' holds whether the answer is desirable .*model\.objective: kto",
    ):
        data.setup("fit")


def test_a_module_and_data_of_other_batch_kinds_are_refused(tiny_model_dir, tmp_path) -> None:
    from lit_instruct.train.module import InstructLoRAModule

    chats = write(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}] * 4,
    )
    module = InstructLoRAModule(model=str(tiny_model_dir), objective="dpo")
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(chats)], batch_size=2)
    with pytest.raises(
        ConfigError, match=r"data\.batch_kind: 'conversations' cannot be combined with model\.objective: dpo"
    ):
        trainer(tmp_path, max_steps=1).fit(module, datamodule=data)
