"""A user's mistake ends with exit status 2 and one line naming the setting, no traceback, before any
weights are read: the model here has unreadable weights, so reading them would fail otherwise."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_instruct.cli import main
from lit_instruct.errors import ConfigError
from lit_instruct.preflight import NOT_PROBED
from lit_instruct.rules import BATCH_KIND, CONFLICTS

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVE_OF_KIND = {
    "pairs": "dpo",
    "unpaired": "kto",
    "prompts": json.dumps({"class_path": "GRPO", "init_args": {"rewards": ["exact_answer"]}}),
}
"""An objective of each batch kind other than conversations."""


@pytest.fixture(scope="module")
def unreadable_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config and tokenizer, with weights that no loader can read."""
    model = tmp_path_factory.mktemp("unreadable") / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not weights")
    return model


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter of a Llama whose hidden size differs from the tiny one's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    folder = tmp_path_factory.mktemp("other-adapter")
    get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        folder
    )
    return folder


def fit_args(model: Path, chat_file: Path, *extra: str) -> list[str]:
    config = str(ROOT / "configs" / "lora.yaml")
    return [
        "fit",
        "--config",
        config,
        "--model.model",
        str(model),
        "--data.train_files",
        f"[{chat_file}]",
        *extra,
    ]


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``lit-instruct`` wrote to stderr as it exited 2."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("lit-instruct:")]
    assert len(lines) == 1, err
    return lines[0]


MISTAKES = [
    (
        ["--model.lora.r", "-4"],
        "lit-instruct: config error: model.lora.r: must be a positive integer, got -4",
    ),
    (
        ["--model.lora.alpha", "0"],
        "lit-instruct: config error: model.lora.alpha: must be a positive number, got 0",
    ),
    (
        ["--model.lora.dropout", "1.5"],
        "lit-instruct: config error: model.lora.dropout: must be in [0, 1), got 1.5",
    ),
    (["--model.lora.init", "pisa"], "lit-instruct: config error: model.lora.init: must be one of default, "),
    (["--model.lora.init", "corda"], "lit-instruct: config error: model.lora.init: 'corda' needs its own"),
    (
        ["--model.lora.layers_to_transform", "[-1]"],
        "config error: model.lora.layers_to_transform: must be a ",
    ),
    (
        ["--data.max_seq_len", "0"],
        "lit-instruct: config error: data.max_seq_len: must be a positive integer, got 0",
    ),
    (
        ["--data.val_fraction", "1.0"],
        "lit-instruct: config error: data.val_fraction: must be in [0, 1), got 1.0",
    ),
    (
        ["--trainer.accumulate_grad_batches", "0"],
        "lit-instruct: config error: trainer.accumulate_grad_batches: must be a positive integer, got 0",
    ),
    (
        ["--model.lora.target_modules", "[nonexistent_proj]"],
        "config error: model.lora.target_modules: 'nonexistent_proj' matches no module of this model",
    ),
    (
        ["--model.lora.target_modules", "[q_proj, v_prj]"],
        "config error: model.lora.target_modules: 'v_prj' matches no module of this model (closest: v_proj",
    ),
    (
        ["--model.lora.target_modules", "[mlp]"],
        "lit-instruct: config error: model.lora.target_modules: ['mlp']: ",
    ),
    (
        ["--model.lora.vision", "all"],
        "lit-instruct: config error: model.lora.vision: all, but LlamaForCausalLM is a text-only model",
    ),
    (
        ["--model.lora.layers_to_transform", "[5]"],
        "lit-instruct: config error: model.lora.layers_to_transform: 5 is not a layer of this model",
    ),
    (
        ["--data.chat_template", "my_template.jinja"],
        "lit-instruct: config error: data.chat_template: 'my_template.jinja' is no file, no Jinja template",
    ),
    (
        ["--model.preference.beta", "0"],
        "lit-instruct: config error: model.preference.beta: must be > 0, got 0",
    ),
    (
        ["--model.preference.kind", "kto"],
        "config error: model.preference.kind: 'kto' is none of dpo, ipo, simpo, orpo (`lit-instruct fit",
    ),
    (
        ["--model.preference.bta", "0.2"],
        "lit-instruct: config error: model.preference.bta: is not a setting (closest: beta)",
    ),
    (
        ["--model.lora.rr", "4"],
        "lit-instruct: config error: model.lora.rr: is not a setting (closest: r); the settings are r, ",
    ),
    (
        ["--model.preference.kind", "dpo2"],
        "config error: model.preference.kind: 'dpo2' is none of dpo, ipo, simpo, orpo (closest: dpo)",
    ),
    (
        ["--data.multi_turn", "jointt"],
        "config error: data.multi_turn: 'jointt' is none of auto, joint, per_turn, last (closest: joint)",
    ),
    (
        ["--model.preference.kind", "simpo", "--model.preference.precompute_reference", "true"],
        "config error: model.preference.precompute_reference: applies to dpo and ipo (they have a ",
    ),
    (
        ["--model.adapter", "no/such/adapter"],
        "lit-instruct: config error: model.adapter: 'no/such/adapter' is no folder; give a PEFT adapter",
    ),
]


@pytest.mark.parametrize(("extra", "line"), MISTAKES, ids=[m[0][0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2_before_the_weights(
    extra: list[str], line: str, unreadable_model: Path, chat_file: Path, capsys
) -> None:
    assert line in refused(fit_args(unreadable_model, chat_file, *extra), capsys)


def test_a_model_folder_that_does_not_exist_is_named(tmp_path: Path, chat_file: Path, capsys) -> None:
    missing = tmp_path / "my-model"
    line = refused(fit_args(missing, chat_file), capsys)
    assert line.startswith(f"lit-instruct: config error: model.model: '{missing}' is no folder here; give a ")


def test_a_folder_without_config_json_is_named(tmp_path: Path, chat_file: Path, capsys) -> None:
    line = refused(fit_args(tmp_path, chat_file), capsys)
    assert line.startswith(
        f"lit-instruct: config error: model.model: '{tmp_path}' is a folder without config.json"
    )


def test_an_adapter_that_is_not_lora_is_named(
    unreadable_model: Path, tmp_path: Path, chat_file: Path, capsys
) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "IA3", "target_modules": ["k_proj"]})
    )
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    line = refused(fit_args(unreadable_model, chat_file, "--model.adapter", str(tmp_path)), capsys)
    assert line == f"lit-instruct: config error: model.adapter: '{tmp_path}' is a IA3 adapter, not LoRA: " + (
        "LoRA adapters continue"
    )


def test_an_adapter_of_another_base_is_refused_from_its_headers(
    unreadable_model: Path, other_base_adapter: Path, chat_file: Path, capsys
) -> None:
    line = refused(fit_args(unreadable_model, chat_file, "--model.adapter", str(other_base_adapter)), capsys)
    assert line.startswith(f"lit-instruct: config error: model.adapter: '{other_base_adapter}' does not fit ")
    assert "q_proj.lora_A.weight is [4, 32] in the adapter, [4, 64] here" in line


def cli_value(value: object) -> str:
    return json.dumps(value) if isinstance(value, bool | list | dict) else str(value)


@pytest.mark.parametrize("conflict", CONFLICTS, ids=[f"{c.first}+{c.second}" for c in CONFLICTS])
def test_every_refused_pair_is_refused_at_config_time_naming_both(
    conflict, unreadable_model: Path, chat_file: Path, capsys
) -> None:
    """Each row of the table, with its example values, on the command line: refused before weights."""
    pair = [f"--{conflict.first}", cli_value(conflict.example[0])]
    pair += [f"--{conflict.second}", cli_value(conflict.example[1])]
    if "model.low_memory_load" in (conflict.first, conflict.second) and conflict.second != "trainer.strategy":
        pair += ["--trainer.strategy", "fsdp_lora"]  # else that pair is refused first
    second = f"{conflict.second}: "
    if conflict.second == BATCH_KIND:  # the objective sets it: one of that batch kind
        pair[-2:] = ["--model.objective", OBJECTIVE_OF_KIND[conflict.example[1]]]
        second = f"model.objective (its batch kind: {conflict.example[1]}): "
        if conflict.first != "data.packing":
            pair += ["--data.packing", "false"]  # configs/lora.yaml packs: else that pair is refused first
    line = refused(fit_args(unreadable_model, chat_file, *pair), capsys)
    assert line.startswith(f"lit-instruct: config error: {conflict.first}: ")
    assert f"cannot be combined with {second}" in line
    assert conflict.reason in line


def test_the_batch_kind_is_the_objectives_to_set(unreadable_model: Path, chat_file: Path, capsys) -> None:
    line = refused(fit_args(unreadable_model, chat_file, "--data.batch_kind", "pairs"), capsys)
    assert line.startswith("lit-instruct: config error: data.batch_kind: is set by model.objective")


def test_the_module_refuses_a_pair_before_reading_weights(unreadable_model: Path) -> None:
    """From Python too (no CLI): the build checks the model settings before it loads the base."""
    from lit_instruct import InstructLoRAModule, LoRAConfig

    with pytest.raises(
        ConfigError, match=r"^model.lora.init: 'eva' cannot be combined with model.quantization"
    ):
        InstructLoRAModule(
            model=str(unreadable_model), lora=LoRAConfig(init="eva"), quantization={"method": "nf4"}
        )
    with pytest.raises(ConfigError, match=r"^model.lora.r: must be a positive integer, got 0"):
        InstructLoRAModule(model=str(unreadable_model), lora=LoRAConfig(r=0))


def test_debug_shows_the_traceback(unreadable_model: Path, chat_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.lora\.r"):
        main([*fit_args(unreadable_model, chat_file, "--model.lora.r", "-4"), "--debug"])


def test_the_installed_command_exits_2_with_one_line(unreadable_model: Path, chat_file: Path) -> None:
    """The real entry point, in its own process: nothing but the line on stderr."""
    args = fit_args(unreadable_model, chat_file, "--model.lora.r", "-4")
    done = subprocess.run([sys.executable, "-m", "lit_instruct", *args], capture_output=True, text=True)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "lit-instruct: config error: model.lora.r: must be a positive integer, got -4"
    assert "Traceback" not in done.stderr


def test_check_prints_the_plan_without_weights(
    tiny_model_dir: Path, unreadable_model: Path, chat_file: Path, capsys
) -> None:
    """``check`` on the unreadable model gives the plan a real build of the readable one confirms."""
    from lit_instruct import InstructLoRAModule, LoRAConfig

    main(["check", *fit_args(unreadable_model, chat_file)[1:], "--model.lora.r", "4"])
    out = capsys.readouterr().out
    built = InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4))
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    coverage = built.model.lora_coverage.line()
    assert (
        f"lit-instruct check: adapters: {coverage} ({NOT_PROBED}); {trainable:,} trainable parameters" in out
    )
    base = sum(p.numel() for name, p in built.base_model.named_parameters() if "lora_" not in name)
    assert f"lit-instruct check: model: {unreadable_model} (llama, {base:,} parameters)" in out
    assert "peak memory estimate: " in out


def test_the_docs_list_every_refused_pair() -> None:
    """Each row of the table of refused pairs is in the table of docs/config.md, and no other row is."""
    text = (ROOT / "docs" / "config.md").read_text()
    table = text.split("**Refused pairs**", 1)[1].split("\n\n", 2)[1]
    rows = [line.split(" | ")[:2] for line in table.splitlines()[2:]]
    listed = [(re.findall(r"`([\w.]+)", a)[0], re.findall(r"`([\w.]+)", b)[0]) for a, b in rows]
    assert sorted(listed) == sorted((c.first, c.second) for c in CONFLICTS)


NO_ADAPTER = "config error: --adapter: 'nope' is no folder; "


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["generate", "--adapter", "nope", "--prompt", "hi"], NO_ADAPTER),
        (["export", "--adapter", "nope", "--out", "x"], NO_ADAPTER),
        (["eval", "--adapter", "nope", "--data", "x.jsonl"], NO_ADAPTER),
        (["chat", "--model", "./nope"], "config error: --model: './nope' is no folder here; "),
    ],
    ids=["generate", "export", "eval", "chat"],
)
def test_the_other_commands_name_a_wrong_path(command: list[str], line: str, capsys) -> None:
    assert refused(command, capsys).startswith(f"lit-instruct: {line}")
