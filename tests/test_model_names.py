"""Where a model name points, and the name an adapter records for its base: the hub id of a bundled
model (which loads the bundled copy here, offline), else the name as the user gave it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from lit_instruct.adapter_folder import save_adapter
from lit_instruct.model_names import (
    SMOLLM2_HUB_ID,
    SMOLLM2_NAME,
    cache_dir,
    portable_name,
    resolve_model_path,
)
from lit_instruct.preflight.model_source import model_source


@pytest.mark.parametrize(
    ("given", "recorded"),
    [
        (SMOLLM2_NAME, SMOLLM2_HUB_ID),
        (SMOLLM2_HUB_ID, SMOLLM2_HUB_ID),
        (str(cache_dir() / SMOLLM2_NAME), SMOLLM2_HUB_ID),  # the path older adapters recorded
        ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
        ("models/my-base", "models/my-base"),
        (str(cache_dir() / "my-base"), str(cache_dir() / "my-base")),
    ],
)
def test_an_adapter_records_its_base_as_users_and_the_hub_know_it(given: str, recorded: str) -> None:
    assert portable_name(given) == recorded


def test_the_hub_id_of_a_bundled_model_loads_the_bundled_copy_offline(
    smollm2_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(SMOLLM2_HUB_ID) == str(smollm2_path)
    assert model_source(SMOLLM2_HUB_ID) == str(smollm2_path)


def test_a_saved_adapter_names_the_portable_base_in_its_config_and_card(
    tiny_model_dir: Path, tmp_path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert peft_model.peft_config["default"].base_model_name_or_path == str(tiny_model_dir)
    folder = save_adapter(peft_model, tmp_path / "adapter", base=SMOLLM2_NAME)
    assert (
        json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == SMOLLM2_HUB_ID
    )
    assert ModelCard.load(folder / "README.md").data.base_model == SMOLLM2_HUB_ID
    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder
    )  # peft still reads it
