"""The adapter folder's model card (issue 50): base, objective, LoRA settings, the training sources'
counts, steps and the last validation, with the Hub's front matter; the bundled base's provenance."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard

from lit_instruct.model_card import TrainingCard
from lit_instruct.model_names import SMOLLM2_HUB_ID, SMOLLM2_NAME
from tests.helpers import make, trainer


def test_the_adapter_folder_carries_a_card_of_its_training(
    tiny_model_dir: Path, chat_file: Path, tmp_path
) -> None:
    module, data = make(tiny_model_dir, chat_file, adapter_dir=str(tmp_path / "adapter"))
    run = trainer(tmp_path, max_steps=2)
    run.fit(module, datamodule=data)
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    assert card.data.base_model == str(tiny_model_dir) and card.data.library_name == "peft"
    assert "sft" in card.data.tags
    text = card.text
    assert "SFT (the loss on response tokens only), 2 optimizer steps" in text
    assert "| r | 4 |" in text and "| alpha | 8 |" in text
    counts = data.prepared.counts["train"][chat_file.stem]
    assert f"| {chat_file.stem} | {counts['samples']:,} | {counts['response_tokens']:,} |" in text
    assert f"| val/loss | {float(run.callback_metrics['val/loss']):.4f} |" in text
    assert "Q4_1" not in text  # not the bundled base


def test_a_card_of_the_bundled_base_says_where_its_weights_came_from() -> None:
    text = TrainingCard(SMOLLM2_NAME, "dpo", {"r": 8}, 10).text()
    assert f"base_model: {SMOLLM2_HUB_ID}" in text and "tags: [lit-instruct, lora, dpo]" in text
    assert "Q4_1 GGUF dequantized to fp32, not the Hub's own weights" in text
