"""SampleScores: held-out prompts and references from the validation samples, greedy answers as
``generate`` gives them, ROUGE-L / chrF / exact match against hand-computed values, over ranks,
and what a validation logs (metrics.csv, samples.md, the W&B table, the fit report)."""

from __future__ import annotations

import csv
import json
import logging
import multiprocessing
import re
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lit_instruct.callbacks import SampleScores
from lit_instruct.callbacks.sample_scores import (
    SCORE_KEYS,
    greedy_answer,
    held_out_conversations,
    last_answer_span,
    sample_scores,
)
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.sources import read_source
from lit_instruct.infer.generate import generate
from lit_instruct.labels import IGNORE_INDEX
from tests import wandb_reader
from tests.conftest import CHATS
from tests.helpers import make, trainer, write_chats

# -- independent references ---------------------------------------------------------------------


def rouge_l_reference(answer: str, reference: str) -> float:
    """ROUGE-L F1 over lowercase alphanumeric words (rouge-score's default tokenization), by a
    longest-common-subsequence table."""
    a, b = (re.findall("[a-z0-9]+", text.lower()) for text in (answer, reference))
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    lcs = table[-1][-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def chrf_reference(pairs: list[tuple[str, str]], order: int = 6, beta: float = 2.0) -> float:
    """Corpus chrF (Popović's, as sacrebleu 2 computes it): character n-gram counts (spaces removed)
    summed over the corpus, an F-beta per order, averaged over the orders."""
    hyp: Counter[int] = Counter()
    ref: Counter[int] = Counter()
    match: Counter[int] = Counter()
    for texts in pairs:
        answer, reference = (text.strip().replace(" ", "") for text in texts)
        for n in range(1, order + 1):
            grams = [Counter(t[i : i + n] for i in range(len(t) - n + 1)) for t in (answer, reference)]
            hyp[n] += sum(grams[0].values())
            ref[n] += sum(grams[1].values())
            match[n] += sum((grams[0] & grams[1]).values())
    scores = []
    for n in range(1, order + 1):
        precision = match[n] / hyp[n] if hyp[n] else 0.0
        recall = match[n] / ref[n] if ref[n] else 0.0
        denominator = beta**2 * precision + recall
        scores.append((1 + beta**2) * precision * recall / denominator if denominator else 0.0)
    return sum(scores) / order


def scores_reference(answers: list[str], references: list[str]) -> dict[str, float]:
    pairs = list(zip(answers, references, strict=True))
    return {
        "val/gen/rougeL": sum(rouge_l_reference(a, r) for a, r in pairs) / len(pairs),
        "val/gen/chrf": sum(chrf_reference([pair]) for pair in pairs) / len(pairs),
        "val/gen/exact_match": sum(a.strip() == r.strip() for a, r in pairs) / len(pairs),
    }


def messages(chat: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in chat]


def held_out_of(tokenizer, path: Path, count: int = 10, **renderer_kwargs):
    renderer = ChatRenderer(tokenizer, renderer_kwargs.pop("max_seq_len", 512), **renderer_kwargs)
    samples = [sample for record in read_source(path) for sample in renderer.samples(record)[0]]
    return held_out_conversations(samples, tokenizer, count)


def scrambled(module, scale: float = 1.0):
    """The module with its LoRA B drawn (zero at init, where the tiny model only answers newlines):
    varied greedy answers."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return module


# -- prompts and references ---------------------------------------------------------------------


def test_last_answer_span_is_the_last_labelled_run_after_a_prompt() -> None:
    x = IGNORE_INDEX
    assert last_answer_span([x, x, 5, 6, x, x, 7, 8, x]) == (6, 8)
    assert last_answer_span([x, 5, 6]) == (1, 3)
    assert last_answer_span([5, 6, x]) is None  # nothing before it to prompt with
    assert last_answer_span([x, x]) is None
    assert last_answer_span([]) is None


@pytest.mark.parametrize("multi_turn", ["auto", "per_turn"])
def test_a_conversation_is_prompted_with_every_turn_before_its_last_answer(
    multi_turn: str, tokenizer, chat_file: Path
) -> None:
    """The prompt is what ``generate`` gives the model for the turns before the last answer (the
    chat template with its generation prompt); a conversation split per turn counts once."""
    found = held_out_of(tokenizer, chat_file, multi_turn=multi_turn)
    assert len(found) == len(CHATS)
    for item, chat in zip(found, CHATS, strict=True):
        text = tokenizer.apply_chat_template(messages(chat[:-1]), tokenize=False, add_generation_prompt=True)
        assert item.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert item.reference == chat[-1][1]
    assert [item.reference for item in held_out_of(tokenizer, chat_file, count=2)] == ["Paris.", "HELLO!"]


def test_a_tool_call_is_scored_as_the_text_the_template_renders(tokenizer, tmp_path: Path) -> None:
    from tests.test_fields_shown import TOOL_CHAT

    call = (
        '<think>\nAsk the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    )
    rows = [TOOL_CHAT, {**TOOL_CHAT, "messages": TOOL_CHAT["messages"][:3]}]  # ending in the answer, the call
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    answer, tool_call = held_out_of(tokenizer, path, chat_template="chatml-tools")
    assert (answer.reference, tool_call.reference) == ("18C and sunny.", call)
    prompt = tokenizer.decode(answer.prompt_ids)
    assert prompt.endswith(
        call + "<|im_end|>\n<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(tool_call.prompt_ids).endswith(
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_truncated_and_promptless_samples_are_left_out(tokenizer, tmp_path: Path) -> None:
    long = [("user", "Hi"), ("assistant", "word " * 40)]  # 74 tokens rendered; the others 41 and 56
    path = write_chats(tmp_path / "chats.jsonl", [long, *CHATS[:2]])
    assert [item.reference for item in held_out_of(tokenizer, path, max_seq_len=64)] == ["Paris.", "HELLO!"]
    assert held_out_of(tokenizer, path, train_on="all") == []  # every token trained: no prompt


# -- answers and scores -------------------------------------------------------------------------


def test_greedy_answers_equal_generate(tiny_model_dir: Path, chat_file: Path, tokenizer) -> None:
    module, _ = make(tiny_model_dir, chat_file, dtype="float32")
    model = scrambled(module).model.eval()
    answers = []
    for item, chat in list(zip(held_out_of(tokenizer, chat_file), CHATS, strict=True))[:3]:  # 1 and 2 turns
        answer = greedy_answer(model, tokenizer, item.prompt_ids, max_new_tokens=6)
        assert answer == generate(model, tokenizer, messages(chat[:-1]), max_new_tokens=6)
        answers.append(answer)
    assert len(set(answers)) > 1 and all(answer.strip() for answer in answers)


SCORED = [  # (answer, reference)
    ("The cat sat on the mat.", "the cat sat on a mat"),
    ("  Paris. ", "Paris."),  # equal once stripped
    ("Blue and green", "The sky is blue"),
    ("", "Nothing matches"),
]


def test_scores_equal_hand_computed_rouge_l_chrf_and_exact_match() -> None:
    answers, references = map(list, zip(*SCORED, strict=True))
    scores = sample_scores(answers, references, torch.device("cpu"))
    expected = scores_reference(answers, references)
    assert list(scores) == list(SCORE_KEYS)
    for key in SCORE_KEYS:
        torch.testing.assert_close(scores[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    assert expected["val/gen/exact_match"] == 0.25 and 0 < expected["val/gen/rougeL"] < 1
    # an answer with nothing in common with its reference counts (torchmetrics' corpus chrF drops it)
    torch.testing.assert_close(
        scores["val/gen/chrf"], 3 / 4 * sample_scores(answers[:3], references[:3], "cpu")["val/gen/chrf"]
    )
    torch.testing.assert_close(rouge_l_reference(*SCORED[0]), 2 * (5 / 6) * (5 / 6) / (5 / 3))  # LCS 5 of 6


def _score_on_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for count in (len(SCORED), 1):  # 2 and 2 samples; then 1 and none
            share = SCORED[:count][rank::2]
            answers, references = [a for a, _ in share], [r for _, r in share]
            results.put((rank, count, sample_scores(answers, references, torch.device("cpu"))))
    finally:
        dist.destroy_process_group()


def test_two_ranks_scoring_their_shares_give_the_scores_of_one() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")  # no re-import: well under a second
    results = context.Queue()
    ranks = [context.Process(target=_score_on_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = [results.get(timeout=60) for _ in range(4)]
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    for rank, count, scores in got:
        answers, references = [a for a, _ in SCORED[:count]], [r for _, r in SCORED[:count]]
        expected = sample_scores(answers, references, torch.device("cpu"))
        assert scores.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(scores[key], expected[key], rtol=1e-6, atol=0, msg=f"{rank} {key}")


# -- a real fit -----------------------------------------------------------------------------------


def csv_rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", encoding="utf-8") as rows:
        return list(csv.DictReader(rows))


def test_each_validation_logs_scores_to_metrics_csv_samples_md_and_the_wandb_table(
    tiny_model_dir: Path, tmp_path: Path, tokenizer
) -> None:
    """References made from the model's own answers (its weights do not move: learning rate 0), so
    that every score is away from 0: one answer exactly, one in part, one not."""
    prompts = [[("user", "Name a colour.")], [("system", "Be brief."), ("user", "2+2?")], [("user", "Hi")]]
    module, _ = make(tiny_model_dir, tmp_path / "unused.jsonl", dtype="float32", learning_rate=0.0)
    model = scrambled(module).model.eval()
    answers = [generate(model, tokenizer, messages(chat), max_new_tokens=6) for chat in prompts]
    half = " ".join(answers[1].split()[: max(1, len(answers[1].split()) // 2)])
    references = [answers[0].strip(), f"{half} and more", "Hello there!"]
    chats = [[*chat, ("assistant", reference)] for chat, reference in zip(prompts, references, strict=True)]
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(write_chats(tmp_path / "train.jsonl", CHATS))],
        val_files=[str(write_chats(tmp_path / "val.jsonl", chats))],
        batch_size=3,
    )
    loggers = [CSVLogger(tmp_path, name=""), WandbLogger(save_dir=tmp_path, offline=True)]
    scores = SampleScores(num_samples=3, max_new_tokens=6)
    run = trainer(tmp_path, max_steps=4, val_check_interval=2, logger=loggers, callbacks=[scores])
    run.fit(module, datamodule=data)
    loggers[1].experiment.finish()

    expected = scores_reference(answers, references)
    assert 0 < expected["val/gen/rougeL"] < 1 and 0 < expected["val/gen/chrf"] < 1
    assert expected["val/gen/exact_match"] == pytest.approx(1 / 3)
    validations = [row for row in csv_rows(tmp_path / "version_0") if row["val/loss"]]
    assert [int(row["step"]) for row in validations] == [1, 3]  # after steps 2 and 4
    for row in validations:
        for key in SCORE_KEYS:
            torch.testing.assert_close(float(row[key]), expected[key], rtol=1e-5, atol=1e-6, msg=key)

    assert [(step, answer) for step, _, _, answer in scores.history] == [
        (step, answer) for step in (1, 3) for answer in answers
    ]
    assert [reference for _, _, reference, _ in scores.history] == references * 2
    markdown = (tmp_path / "version_0" / "samples.md").read_text()
    assert re.findall(r"^## step (\d+)$", markdown, re.MULTILINE) == ["1", "3"]
    assert markdown.count("### sample ") == 6 and f"```text\n{answers[2]}\n```" in markdown
    assert f"### sample 2: {tmp_path / 'val.jsonl'}:2\n" in markdown  # where to find the record
    restored = SampleScores()
    restored.load_state_dict(scores.state_dict())  # a resumed run's table goes on from here
    assert restored.history == scores.history

    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    rows = wandb_reader.settled_history(next(run_dir.glob("run-*.wandb")), "val/samples/path", rows=2)
    tables = [
        (row["trainer/global_step"], row["val/samples/path"]) for row in rows if "val/samples/path" in row
    ]
    assert [step for step, _ in tables] == [1, 3]
    table = json.loads((run_dir / "files" / tables[-1][1]).read_text())
    assert table["columns"] == ["step", "prompt", "reference", "answer"]
    assert table["data"] == [[str(value) for value in row] for row in scores.history]


def test_the_fit_report_shows_the_best_step_as_metrics_csv_does_and_the_cost(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module, data = make(tiny_model_dir, chat_file, learning_rate=1e-2)
    scores = SampleScores(num_samples=2, max_new_tokens=4)
    run = trainer(
        tmp_path, max_steps=6, val_check_interval=2, logger=CSVLogger(tmp_path, name=""), callbacks=[scores]
    )
    with caplog.at_level(logging.INFO):
        run.fit(module, datamodule=data)
    validations = [row for row in csv_rows(tmp_path / "version_0") if row["val/loss"]]
    best = min(validations, key=lambda row: float(row["val/loss"]))
    report = "\n".join(r.getMessage() for r in caplog.records if "fit done" in r.getMessage())
    assert f"best val/loss {float(best['val/loss']):.4f} at step {best['step']} (as logged)" in report
    cost = re.search(
        r"generating samples to score \(SampleScores\): ([\d.]+) s \(([\d.]+)% of the fit\)", report
    )
    assert cost is not None and float(cost.group(1)) == pytest.approx(scores.fit_seconds, abs=0.05)
    assert scores.fit_seconds > 0 and 0 < float(cost.group(2)) < 100
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lit-instruct samples @")]
    assert said[:2] == [
        "lit-instruct samples @ step 1: generating 2 greedy answers of up to 4 tokens to score",  # as logged
        said[1],  # the scores, after the answers
    ]
    assert re.search(r"over 2 conversations \(\d+s\)$", said[1]) and len(said) == 2 * len(validations)


def test_without_validation_data_it_says_so_once_and_does_nothing(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    scores = SampleScores()
    with pytest.warns(UserWarning, match="SampleScores: no validation conversation") as said:
        for _ in range(2):
            module, _ = make(tiny_model_dir, chat_file)
            data = InstructDataModule(
                tokenizer=str(tiny_model_dir), train_files=[str(chat_file)], val_fraction=0.0
            )
            trainer(tmp_path, max_steps=1, callbacks=[scores]).fit(module, datamodule=data)
    assert sum("SampleScores" in str(warning.message) for warning in said) == 1
    assert scores.history == [] and not list(tmp_path.rglob("samples.md"))


def test_num_samples_zero_is_off_and_bad_settings_are_refused(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, recwarn
) -> None:
    module, data = make(tiny_model_dir, chat_file)
    run = trainer(tmp_path, max_steps=1, val_check_interval=1, callbacks=[SampleScores(num_samples=0)])
    run.fit(module, datamodule=data)
    assert "val/loss" in run.callback_metrics and not any(
        k.startswith("val/gen/") for k in run.callback_metrics
    )
    assert not any("SampleScores" in str(warning.message) for warning in recwarn)
    assert not list(tmp_path.rglob("samples.md"))
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        SampleScores(num_samples=-1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SampleScores(max_new_tokens=0)
