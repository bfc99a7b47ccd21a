"""Writing, checking and loading an adapter whose base is named by its hub id asks the Hub nothing and
warns nothing (issue 50: peft's "Could not find a config file" three times per run from an adapter)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lit_instruct.adapter_folder import read_config, read_weights, save_adapter
from lit_instruct.model_names import SMOLLM2_HUB_ID
from lit_instruct.models.lora import load_lora
from lit_instruct.preflight.adapter_fit import adapter_on_skeleton


def test_an_adapter_of_a_hub_named_base_is_written_checked_and_loaded_without_peft_warnings(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # peft's Hub lookup then warns instead of calling out
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])
    )
    peft_model.peft_config["default"].base_model_name_or_path = SMOLLM2_HUB_ID
    folder = tmp_path / "adapter"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_adapter(peft_model, folder)
        adapter_on_skeleton(str(folder), AutoModelForCausalLM.from_pretrained(tiny_model_dir), SMOLLM2_HUB_ID)
        load_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)
    assert read_config(folder)["base_model_name_or_path"] == SMOLLM2_HUB_ID
    peft_warnings = [str(w.message) for w in caught if "config file" in str(w.message)]
    assert peft_warnings == []
    assert all("lora_" in key for key in read_weights(folder))  # no embedding copies added
