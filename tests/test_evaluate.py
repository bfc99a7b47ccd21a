"""``lit-instruct eval``: the adapter's numbers are validation's; ``--base`` gives the base model's; the
table is aligned; ``--answers`` shows its progress."""

from __future__ import annotations

import io
import json
import re

import torch

from lit_instruct.cli import main
from lit_instruct.infer.evaluate import Progress, results_table
from tests.helpers import make, trainer


def test_eval_numbers_equal_validation_for_the_same_data(tiny_model_dir, chat_file, tmp_path, capsys) -> None:
    module, data = make(tiny_model_dir, chat_file, learning_rate=5e-2)
    fit = trainer(tmp_path, max_steps=4, limit_val_batches=0)
    fit.fit(module, datamodule=data)
    adapter = tmp_path / "adapter"
    (expected,) = trainer(tmp_path).validate(module, datamodule=data, verbose=False)  # val_files = chat_file

    from lit_instruct.infer.evaluate import evaluate, load_adapter_module

    loaded = load_adapter_module(adapter, str(tiny_model_dir))
    results = evaluate(loaded, [str(chat_file)], with_base=True)
    for name in ("val/loss", "val/ppl", "val/tokens"):
        torch.testing.assert_close(results["adapter"][name], float(expected[name]), rtol=1e-5, atol=1e-6)
    base_module, _ = make(tiny_model_dir, chat_file)  # fresh LoRA: B = 0, the base model's outputs
    (base,) = trainer(tmp_path).validate(base_module, datamodule=data, verbose=False)
    torch.testing.assert_close(results["base"]["val/loss"], float(base["val/loss"]), rtol=1e-5, atol=1e-6)
    assert results["adapter"]["val/loss"] < results["base"]["val/loss"]

    answers = tmp_path / "answers.jsonl"
    main(
        [
            "eval",
            "--adapter",
            str(adapter),
            "--data",
            str(chat_file),
            "--model",
            str(tiny_model_dir),
            "--base",
            "--answers",
            str(answers),
            "--max-new-tokens",
            "3",
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out.splitlines()
    header = printed.index(next(line for line in printed if "val/loss" in line))
    adapter_row, base_row = printed[header + 1], printed[header + 2]
    assert re.match(rf"adapter\s+{results['adapter']['val/loss']:.4f}\s", adapter_row), adapter_row
    assert re.match(rf"base\s+{results['base']['val/loss']:.4f}\s", base_row), base_row
    assert printed[-1] == f"answers written to {answers}"

    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(rows) == len(chat_file.read_text().splitlines())
    assert rows[0]["source"] == f"{chat_file}:1" and rows[0]["messages"][-1]["role"] == "user"
    assert all(isinstance(row["answer"], str) for row in rows)
    progress = [line for line in captured.err.splitlines() if line.startswith("answers:")]
    assert progress[0] == "answers: 0/6 (0s)"  # not a terminal: a line at the start...
    assert re.fullmatch(r"answers: 6/6 in \d+s", progress[-1]), progress  # ... and one at the end


def test_the_table_separates_and_aligns_its_columns() -> None:
    adapter = {"val/loss": 1.23456, "val/loss/alpaca_sample": 0.5, "val/ppl": 3.43689, "val/tokens": 1234.0}
    base = {"val/loss": 10.5, "val/loss/alpaca_sample": float("nan"), "val/ppl": 36315.5, "val/tokens": 1234}
    results = {"adapter": adapter, "base": base}
    assert results_table(results) == (
        "model    val/loss  val/loss/alpaca_sample   val/ppl  val/tokens\n"
        "adapter    1.2346                  0.5000      3.44        1234\n"
        "base      10.5000                       -  36315.50        1234\n"
    )


class Clock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_every_so_often_when_piped_and_one_redrawn_line_on_a_terminal() -> None:
    clock, piped = Clock(), io.StringIO()
    progress = Progress("answers", 4, piped, every_s=10, clock=clock)
    for done, seconds in enumerate([0, 4, 9, 16, 130]):  # the time when each is done
        clock.now = 100 + seconds
        progress.update(done)
    assert piped.getvalue() == (
        "answers: 0/4 (0s)\n"  # at the start: it has begun
        "answers: 3/4 (16s, about 5s left)\n"  # 10 s after the last line (1 and 2 came sooner)
        "answers: 4/4 in 2m10s\n"  # at the end: the time taken
    )
    clock, terminal = Clock(), Terminal()
    progress = Progress("answers", 2, terminal, every_s=10, clock=clock)
    for done in range(3):
        clock.now += 1
        progress.update(done)
    assert terminal.getvalue() == (
        "\ranswers: 0/2 (1s)"
        "\ranswers: 1/2 (2s, about 2s left)"
        "\ranswers: 2/2 in 3s              \n"  # padded over the longer line before it
    )
