"""``lit-instruct eval``: the adapter's numbers are validation's; ``--base`` gives the base model's."""

from __future__ import annotations

import json
import re

import torch

from lit_instruct.cli import main
from tests.helpers import make, trainer


def test_eval_numbers_equal_validation_for_the_same_data(tiny_model_dir, chat_file, tmp_path, capsys) -> None:
    module, data = make(tiny_model_dir, chat_file, learning_rate=5e-2)
    fit = trainer(tmp_path, max_steps=4, limit_val_batches=0)
    fit.fit(module, datamodule=data)
    adapter = tmp_path / "adapter"
    (expected,) = trainer(tmp_path).validate(module, datamodule=data, verbose=False)  # val_files = chat_file

    from lit_instruct.infer.evaluate import evaluate, load_adapter_module, write_answers

    loaded = load_adapter_module(adapter, str(tiny_model_dir))
    results = evaluate(loaded, [str(chat_file)], with_base=True)
    for name in ("val/loss", "val/ppl", "val/tokens"):
        torch.testing.assert_close(results["adapter"][name], float(expected[name]), rtol=1e-5, atol=1e-6)
    base_module, _ = make(tiny_model_dir, chat_file)  # fresh LoRA: B = 0, the base model's outputs
    (base,) = trainer(tmp_path).validate(base_module, datamodule=data, verbose=False)
    torch.testing.assert_close(results["base"]["val/loss"], float(base["val/loss"]), rtol=1e-5, atol=1e-6)
    assert results["adapter"]["val/loss"] < results["base"]["val/loss"]

    out = write_answers(loaded, [str(chat_file)], tmp_path / "answers.jsonl", 3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(chat_file.read_text().splitlines())
    assert rows[0]["source"] == f"{chat_file}:1" and rows[0]["messages"][-1]["role"] == "user"
    assert all(isinstance(row["answer"], str) for row in rows)

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
        ]
    )
    printed = capsys.readouterr().out.splitlines()
    header = printed.index(next(line for line in printed if "val/loss" in line))
    adapter_row, base_row = printed[header + 1], printed[header + 2]
    assert re.match(rf"adapter\s+{results['adapter']['val/loss']:.4f}\s", adapter_row), adapter_row
    assert re.match(rf"base\s+{results['base']['val/loss']:.4f}\s", base_row), base_row
