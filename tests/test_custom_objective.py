"""A user's own objective (``examples/per_answer_sft.py``, the one docs/objectives.md shows): its
loss equals one computed from the model's own logits, and it trains from Python and through
``lit-instruct fit`` (issue 51)."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch

from examples.per_answer_sft import PerAnswerSFT
from lit_instruct.cli import main
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from tests.helpers import lora_fit_args, make

ROOT = Path(__file__).resolve().parents[1]


def reference_loss(module, batch: dict) -> tuple[torch.Tensor, int]:
    """Summed per-answer mean NLL from the model's own full logits (fp64), and the answers."""
    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    labels = batch["labels"][:, 1:]
    scored = labels != IGNORE_INDEX
    picked = logps.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * scored
    tokens = scored.sum(dim=1)
    return (-(picked.sum(dim=1)) / tokens).sum(), len(tokens)


def test_its_loss_equals_the_models_own_and_it_trains(
    tiny_model_dir: Path, chat_file: Path, tmp_path
) -> None:
    module, data = make(tiny_model_dir, chat_file, objective=PerAnswerSFT())
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module.train()
    sums = module.objective_sums(batch)
    expected, answers = reference_loss(module, batch)
    assert sums.count == answers
    torch.testing.assert_close(sums.loss_sum.double(), expected, rtol=1e-5, atol=1e-5)
    tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert sums.answer_tokens == tokens and float(sums.metric_sums[0]) == tokens

    trainer = L.Trainer(
        max_steps=2,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name=""),
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        trained = [row for row in csv.DictReader(rows) if row.get("train/loss")]
    assert [row["train/answers"] for row in trained] == ["3.0", "3.0"]  # batch_size 3: answers averaged
    assert module.hparams["objective"]["class_path"] == "examples.per_answer_sft.PerAnswerSFT"


def test_it_refuses_what_it_cannot_take_before_weights(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.packing: must be false with model\.objective: per_answer"):
        make(tiny_model_dir, tiny_model_dir, objective=PerAnswerSFT(), packing=True)


def test_it_trains_through_the_cli(tiny_model_dir: Path, chat_file: Path, tmp_path) -> None:
    args = lora_fit_args(
        tiny_model_dir, chat_file, "--model.objective", "examples.per_answer_sft.PerAnswerSFT"
    )
    args += ["--model.objective.min_tokens", "2", "--data.packing", "false", "--trainer.max_steps", "2"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"]
    args += ["--trainer.enable_progress_bar", "false", "--validate_before_fit", "false"]
    args += ["--model.adapter_dir", str(tmp_path / "adapter")]
    main(args)
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "per_answer_sft" in card


def test_the_docs_show_the_example_as_it_is() -> None:
    page = (ROOT / "docs" / "objectives.md").read_text(encoding="utf-8")
    example = (ROOT / "examples" / "per_answer_sft.py").read_text(encoding="utf-8")
    assert f"```python\n{example}```" in page
