"""Preference pairs from ``datasets`` sources (a parquet file, a ``save_to_disk`` folder, JSON Lines)
through :class:`InstructDataModule`, against an independent rendering; errors at ``<path>:row N``;
held-out prompts; and ``lit-instruct inspect`` / ``check`` on ``configs/dpo.yaml``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lit_instruct.cli import main
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.pair_batches import hold_out_prompts
from lit_instruct.data.preference import to_preference_record
from lit_instruct.data.prepare import hold_out
from lit_instruct.data.records import DataError
from lit_instruct.errors import ConfigError
from lit_instruct.preflight import ModelPlan
from lit_instruct.preflight.plan import estimate_memory
from tests.test_preference_data import _expected

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hi.", "Capital of Italy?"]
ANSWERS = [("Four.", "Five, maybe."), ("Green.", "Loud."), ("Hi!", "No."), ("Rome.", "Milan, I believe.")]


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def ultrafeedback_rows(reversed_row: int | None = None) -> list[dict]:
    """Rows laid out as ``HuggingFaceH4/ultrafeedback_binarized``'s (``reversed_row``: its scores swapped)."""
    rows = []
    for i, (question, (good, bad)) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        chosen = [_turn("user", question), _turn("assistant", good)]
        scores = (9.0, 1.0) if i != reversed_row else (1.0, 9.0)
        rows.append(
            {
                "prompt": question,
                "prompt_id": f"id{i}",
                "chosen": chosen,
                "rejected": [_turn("user", question), _turn("assistant", bad)],
                "messages": chosen,
                "score_chosen": scores[0],
                "score_rejected": scores[1] if i else 9.0,  # row 0: a tie
            }
        )
    return rows


def write(kind: str, rows: list[dict], folder: Path) -> tuple[str, str]:
    """The rows written by ``datasets`` as ``kind``; the path and how row ``{}`` is located."""
    from datasets import Dataset

    dataset = Dataset.from_list(rows)
    if kind == "parquet":
        path = folder / "prefs.parquet"
        dataset.to_parquet(str(path))
    elif kind == "saved":
        path = folder / "prefs"
        dataset.save_to_disk(str(path))
    else:
        path = folder / "prefs.jsonl"
        dataset.to_json(str(path))  # JSON Lines
        return str(path), f"{path}:{{line}}"
    return str(path), f"{path}:row {{row}}"


def module(tiny_model_dir: Path, path: str, **settings) -> InstructDataModule:
    data = InstructDataModule(
        batch_kind="pairs",
        tokenizer=str(tiny_model_dir),
        train_files=[path],
        val_fraction=0.0,
        cache=False,
        **settings,
    )
    data.setup("fit")
    return data


@pytest.mark.parametrize("kind", ["parquet", "saved", "jsonl"])
def test_datasets_sources_give_the_pairs_and_name_a_bad_row(kind, tiny_model_dir, tokenizer, tmp_path):
    path, where = write(kind, ultrafeedback_rows(reversed_row=2), tmp_path)
    with pytest.raises(DataError) as caught:
        module(tiny_model_dir, path)
    bad = where.format(row=2, line=3)
    assert str(caught.value) == (
        f"{bad}: field 'score_chosen' (1) is below 'score_rejected' (9): the chosen answer scored worse, "
        "training would prefer the worse answer (swap the answers or drop the pair)"
    )

    data = module(tiny_model_dir, path, on_bad_record="skip", rejects_file=str(tmp_path / "rejects.jsonl"))
    pairs = data.pairs("train")
    kept = [0, 1, 3]
    assert len(pairs) == len(kept)
    for pair, i in zip(pairs, kept, strict=True):
        context = [_turn("user", QUESTIONS[i])]
        for sample, answer in zip((pair.chosen, pair.rejected), ANSWERS[i], strict=True):
            ids, labels = _expected(tokenizer, context, answer)
            assert (sample.input_ids, sample.labels) == (ids, labels)
            assert sample.source == where.format(row=i, line=i + 1)
    counts = data._prepared().counts["train"][Path(path).stem]
    assert counts["skipped_scores_reversed"] == 1 and counts["tied_scores"] == 1
    assert counts["unused_field_prompt_id"] == 3 and counts["pairs"] == 3


def test_held_out_pairs_are_whole_prompts():
    rows = [{"prompt": f"Q{i % 5}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)]
    records = [to_preference_record(row, f"p:{i}") for i, row in enumerate(rows)]  # 5 prompts, 4 pairs each
    train, val = hold_out_prompts(records, 0.4, seed=7)
    held_out = {r.chosen.messages[0].content for r in val}
    assert len(held_out) == 2 and len(val) == 8  # 2 of 5 prompts, with all their pairs
    assert all(r.chosen.messages[0].content not in held_out for r in train) and len(train) == 12
    for part in (train, val):  # each in reading order
        assert [r.source for r in part] == [r.source for r in records if r in part]
    unique = records[:5]  # one pair per prompt: the SFT split exactly
    assert hold_out_prompts(unique, 0.4, seed=7) == hold_out(unique, 0.4, seed=7)  # type: ignore[arg-type]


def test_a_format_other_than_auto_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.format: 'chat' cannot be combined with model\.objective"):
        InstructDataModule(batch_kind="pairs", train_files=[str(tmp_path / "p.jsonl")], format="chat")


def _dpo_args(command: str, tiny_model_dir: Path, data: str) -> list[str]:
    config = str(ROOT / "configs" / "dpo.yaml")
    return [
        command,
        "--config",
        config,
        "--model.model",
        str(tiny_model_dir),
        "--data.train_files",
        f"[{data}]",
        "--data.val_fraction",
        "0",
    ]


def test_inspect_shows_both_answers_of_each_pair_with_their_trained_spans(
    tiny_model_dir, tokenizer, tmp_path, capsys
):
    path, where = write("jsonl", ultrafeedback_rows(), tmp_path)
    main([*_dpo_args("inspect", tiny_model_dir, path), "--samples", str(len(QUESTIONS))])
    out = capsys.readouterr().out
    assert f"pairs={len(QUESTIONS)}" in out and f"unused_field_prompt_id={len(QUESTIONS)}" in out
    shown = re.findall(r"-- sample \d+ \((\S+ \w+), (\d+) tokens, (\d+) trained\)\n(.*?)\n\n", out, re.DOTALL)
    expected = []
    for i, question in enumerate(QUESTIONS):
        for side, answer in zip(("chosen", "rejected"), ANSWERS[i], strict=True):
            ids, labels = _expected(tokenizer, [_turn("user", question)], answer)
            trained = sum(label != -100 for label in labels)
            expected.append((f"{where.format(line=i + 1)} {side}", str(len(ids)), str(trained), answer))
    assert [(origin, n, k) for origin, n, k, _ in shown] == [e[:3] for e in expected]
    for (_, _, _, text), (*_, answer) in zip(shown, expected, strict=True):
        assert re.findall(r"\[\[(.*?)\]\]", text, re.DOTALL) == [f"{answer}<|im_end|>"]  # only the answer


def test_check_counts_pairs_and_both_rows_of_each(tiny_model_dir, tokenizer, tmp_path, capsys):
    path, _ = write("jsonl", ultrafeedback_rows(), tmp_path)
    main(_dpo_args("check", tiny_model_dir, path))
    out = capsys.readouterr().out
    tokens = sum(
        len(_expected(tokenizer, [_turn("user", q)], answer)[0])
        for q, answers in zip(QUESTIONS, ANSWERS, strict=True)
        for answer in answers
    )
    n = len(QUESTIONS)
    assert f"lit-instruct check: data [train]: {n} pairs ({2 * n} rows), {tokens:,} tokens;" in out
    assert "activations of a 8 x 128 batch (4 pairs)" in out  # dpo.yaml: batch_size 4, max_seq_len 128


def test_the_memory_estimate_of_a_pair_batch_is_that_of_its_rows():
    plan = ModelPlan(
        "x", "llama", 10**6, 10**4, "", layers=4, hidden=64, intermediate=256, quantized_linear=0
    )
    sft = {"model.model": "x", "data.batch_size": 8, "data.max_seq_len": 128}
    pairs = {**sft, "data.batch_size": 4, "model.preference": {"kind": "dpo"}}
    assert estimate_memory(plan, pairs) == estimate_memory(plan, sft)
    assert (
        estimate_memory(plan, {**pairs, "model.preference": None}).activations * 2
        == estimate_memory(plan, sft).activations
    )
