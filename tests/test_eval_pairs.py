"""``lit-instruct eval`` on preference pairs (issue 50): the adapter's preference metrics equal DPO's
formula on peft's own log-probabilities, against the base or a reference adapter, with the loss the
adapter's card records; the mistakes are one line, exit 2, before any weight is read."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lit_instruct.cli import main
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.kind import data_kind
from lit_instruct.errors import ConfigError
from lit_instruct.infer.evaluate_pairs import evaluate_pairs, load_pair_module, pair_settings
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.model_card import TrainingCard, recorded_preference
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import write_pairs
from tests.test_preference_loss import _perturb_lora

BETA = 0.2
ANSWERS = [
    "Yes.",
    "No",
    "A long answer of a good many words, " * 3,
    "Four.",
    "A medium answer, of some words.",
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eval-pairs")


@pytest.fixture(scope="module")
def pairs_file(folder: Path) -> Path:
    return write_pairs(folder / "pairs.jsonl", ANSWERS)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, folder: Path) -> dict[str, Path]:
    """Random LoRA B matrices, no training: a DPO adapter (beta 0.2 on its card) and a reference of its
    structure; an SFT adapter of another structure."""
    lora = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    dpo = InstructLoRAModule(model=str(tiny_model_dir), lora=lora, preference=PreferenceConfig(beta=BETA))
    written = {}
    for seed, name in enumerate(("dpo", "ref")):
        _perturb_lora(dpo.model, seed=seed)
        written[name] = dpo.write_adapter(folder / name)
    sft = InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=8, alpha=8))
    _perturb_lora(sft.model, seed=2)
    written["sft"] = sft.write_adapter(folder / "sft")
    return written


def _answer_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Each row's summed log-probability of its answer tokens, from the model's full logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    per_token = torch.log_softmax(logits[:, :-1].double(), -1).gather(2, labels.clamp(min=0)[..., None])
    return (per_token.squeeze(2) * (labels != IGNORE_INDEX)).sum(1)


def _dpo(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, float]:
    """TRL's sigmoid DPO and its metrics, averaged over the pairs (chosen rows first)."""
    pairs = len(policy) // 2
    chosen = beta * (policy[:pairs] - reference[:pairs])
    rejected = beta * (policy[pairs:] - reference[pairs:])
    per_pair = {
        "loss": -F.logsigmoid(chosen - rejected),
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).double(),
        "rewards/margins": chosen - rejected,
        "logps/chosen": policy[:pairs],
        "logps/rejected": policy[pairs:],
    }
    return {f"val/{name}": float(values.mean()) for name, values in per_pair.items()}


@pytest.mark.slow  # two model loads and three validations
def test_pairs_metrics_equal_dpo_on_peft_log_probabilities_against_the_base_and_a_reference_adapter(
    tiny_model_dir, pairs_file, adapters, capsys
):
    config, origin = pair_settings(adapters["dpo"])
    assert (config.kind, config.beta, origin) == ("dpo", BETA, "recorded with the adapter")
    sft, origin = pair_settings(adapters["sft"])
    assert sft == PreferenceConfig() and origin.startswith("the defaults")
    assert data_kind(str(pairs_file)) == "pairs"

    data = InstructDataModule(
        batch_kind="pairs", tokenizer=str(tiny_model_dir), val_files=[str(pairs_file)], eval_batch_size=8
    )
    data.setup("validate")
    (batch,) = list(data.val_dataloader())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapters["dpo"]).eval()
    policy = _answer_logps(peft_model, batch)
    with peft_model.disable_adapter():
        off = _answer_logps(peft_model, batch)
    peft_model.load_adapter(adapters["ref"], adapter_name="ref")
    peft_model.set_adapter("ref")
    by_reference = _answer_logps(peft_model, batch)

    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    module = load_pair_module(adapters["dpo"], config, reference=adapters["ref"])
    (got,) = evaluate_pairs(module, [str(pairs_file)]).values()
    expected = _dpo(policy, by_reference, BETA)
    torch.testing.assert_close({k: got[k] for k in expected}, expected, **tolerance)
    module.reference_adapter = None  # load_pair_module's reference without --reference: the base
    (got,) = evaluate_pairs(module, [str(pairs_file)]).values()
    expected = _dpo(policy, off, BETA)
    assert got["val/pairs"] == len(ANSWERS) and 0 < expected["val/rewards/accuracies"] < 1
    torch.testing.assert_close({k: got[k] for k in expected}, expected, **tolerance)

    # the command, the adapter itself as reference: ln 2, rewards 0, the same log-probabilities
    adapter = str(adapters["dpo"])
    main(["eval", "--adapter", adapter, "--data", str(pairs_file), "--reference", adapter])
    captured = capsys.readouterr()
    header, row = captured.out.splitlines()
    columns = header.split()
    assert columns[:2] == ["model", "val/loss"] and columns[-1] == "val/pairs"
    assert {f"val/{name}" for name in METRICS} <= set(columns) and row.split()[0] == "adapter"
    itself = dict(zip(columns[1:], map(float, row.split()[1:]), strict=True))
    assert itself["val/loss"] == pytest.approx(math.log(2), abs=1e-4) and itself["val/pairs"] == len(ANSWERS)
    assert (
        itself["val/rewards/margins"] == itself["val/rewards/accuracies"] == itself["val/rewards/chosen"] == 0
    )
    assert itself["val/logps/chosen"] == pytest.approx(expected["val/logps/chosen"], abs=6e-5)
    said = "lit-instruct: pairs scored with dpo, beta 0.2 (recorded with the adapter); reference: "
    assert f"{said}{adapter}" in captured.err.splitlines()


def _unloadable(adapter: Path, folder: Path, base: str) -> Path:
    """A copy of ``adapter`` whose base is ``base``: a folder without weights, so that any run that
    reads weights fails, and a refusal must come first."""
    copy = folder / f"{adapter.name}-on-{Path(base).name}"
    if not copy.exists():
        shutil.copytree(adapter, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base
        (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


def test_mistakes_on_pairs_are_one_line_before_any_weight(
    tiny_model_dir, pairs_file, adapters, folder, capsys
):
    nowhere = folder / "no-weights"
    nowhere.mkdir(exist_ok=True)
    (nowhere / "config.json").write_text(json.dumps(json.loads((tiny_model_dir / "config.json").read_text())))
    adapter, same, wide, other_base = (
        _unloadable(adapters["dpo"], folder, str(nowhere)),
        _unloadable(adapters["ref"], folder, str(nowhere)),
        _unloadable(adapters["sft"], folder, str(nowhere)),
        _unloadable(adapters["ref"], folder, "someone/another-base"),
    )
    chats = folder / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
        )
        + "\n"
    )
    eval_pairs = ["eval", "--adapter", str(adapter), "--data", str(pairs_file)]
    chat_eval = ["eval", "--adapter", str(adapter), "--data", str(chats)]
    cases = [  # (argv, the option the line names, what it says)
        (
            [*eval_pairs, str(chats)],
            "--data",
            f"{pairs_file} holds preference pairs and {chats} conversations",
        ),
        ([*eval_pairs, "--answers", "a.jsonl"], "--answers", "needs a judge, which is not built yet"),
        ([*eval_pairs, "--base"], "--base", "the base is already the reference"),
        ([*eval_pairs, "--reference", str(wide)], "--reference", "has LoRA r 8, the adapter 4"),
        (
            [*eval_pairs, "--reference", str(other_base)],
            "--reference",
            "an adapter of 'someone/another-base'",
        ),
        ([*eval_pairs, "--reference", str(same), "--loss", "simpo"], "--reference", "simpo has no reference"),
        ([*chat_eval, "--beta", "0.5"], "--beta", "applies to preference pairs"),
    ]
    for argv, option, words in cases:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2, (argv, err)
        (line,) = err.splitlines()  # one line, no traceback
        assert line.startswith(f"lit-instruct: config error: {option}: ") and words in line, line


def test_the_card_records_the_preference_settings_and_eval_reads_them_back(tmp_path) -> None:
    settings = {"kind": "ipo", "beta": 0.3, "label_smoothing": 0.0}
    (tmp_path / "README.md").write_text(
        TrainingCard("some/base", "ipo", {"r": 8}, 10, preference=settings).text()
    )
    assert recorded_preference(tmp_path) == settings
    assert pair_settings(tmp_path, beta=0.5)[0] == PreferenceConfig(kind="ipo", beta=0.5)
    (tmp_path / "README.md").write_text(TrainingCard("some/base", "orpo", {"r": 8}, 10).text())
    assert recorded_preference(tmp_path) == {"kind": "orpo"}  # an older card: its objective tag
    assert pair_settings(tmp_path) == (
        PreferenceConfig(kind="orpo"),
        "the kind from the adapter's card, the rest defaults",
    )
    newer = {**settings, "some_later_setting": 1.0}
    (tmp_path / "README.md").write_text(
        TrainingCard("some/base", "ipo", {"r": 8}, 10, preference=newer).text()
    )
    with pytest.raises(ConfigError, match=r"^--adapter: .* does not know \(some_later_setting\); score it"):
        pair_settings(tmp_path)
    (tmp_path / "README.md").write_text("---\nlibrary_name: peft\n---\n# Model Card\n")  # peft's own
    assert recorded_preference(tmp_path) is None


def test_a_pairs_file_is_told_by_its_first_readable_record(tmp_path) -> None:
    pair = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    bad_first = tmp_path / "bad_first.jsonl"
    bad_first.write_text("{not json\n" + json.dumps(pair) + "\n", encoding="utf-8")
    bom = tmp_path / "bom.jsonl"
    bom.write_text("\ufeff" + json.dumps(pair) + "\n", encoding="utf-8")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(chat) + "\n", encoding="utf-8")
    assert [data_kind(str(p)) for p in (bad_first, bom, chats)] == ["pairs", "pairs", "conversations"]
