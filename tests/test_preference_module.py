"""Preference training (InstructLoRAModule, InstructDataModule, ``fit --config configs/dpo.yaml``):
step 0 is ln 2 with zero rewards from a fresh adapter and from an SFT adapter (the reference then being
the SFT model, not the base); one training step's loss, metrics and LoRA gradients equal TRL's
``DPOTrainer`` on the same batch; accumulation gives the gradient of the mean over every pair."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import wandb
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from lit_instruct.callbacks import SkipNonFiniteSteps
from lit_instruct.cli import main
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests import wandb_reader
from tests.helpers import (
    FaultyModule,
    GradCapture,
    Recorder,
    StopAfter,
    assert_resumed_as_uninterrupted,
    pair_logps,
    pair_losses,
    recorded_fit,
    trainer,
    write_pairs,
)
from tests.test_preference_loss import (  # noqa: F401  (pair_ids: a fixture)
    LOGPS_METRICS,
    REWARD_METRICS,
    TOLERANCE,
    _dpo_trainer,
    _layout,
    _lora_grads,
    _perturb_lora,
    pair_ids,
)

ROOT = Path(__file__).resolve().parents[1]
LORA = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])  # TRL's side: tests/test_preference_loss
ANSWERS = ["Yes.", "No", " ".join(["a very long answer"] * 12), "Four.", "A medium answer, of some words."]


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    """Five pairs whose answers run from 1 to ~50 tokens."""
    return write_pairs(tmp_path / "pairs.jsonl", ANSWERS)


def _data(tiny_model_dir: Path, pairs_file: Path, batch_size: int) -> InstructDataModule:
    data = InstructDataModule(
        batch_kind="pairs",
        tokenizer=str(tiny_model_dir),
        train_files=[str(pairs_file)],
        val_fraction=0.0,
        batch_size=batch_size,
    )
    data.setup("fit")
    return data


def _first_batch(data: InstructDataModule) -> dict:
    return next(iter(data.train_dataloader()))


def _step_zero(module: InstructLoRAModule, batch: dict) -> tuple[float, dict[str, float]]:
    module.train()
    loss_sum, sums, pairs, _ = pair_losses(module, batch)
    metrics = dict(zip(module.objective.metric_names, (sums / pairs).tolist(), strict=True))
    return float(loss_sum.detach() / pairs), metrics


def test_step_zero_is_ln2_with_zero_rewards_fresh_and_from_an_sft_adapter(
    tiny_model_dir, pairs_file, tmp_path
):
    data = _data(tiny_model_dir, pairs_file, batch_size=5)
    batch = _first_batch(data)
    fresh = InstructLoRAModule(
        model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8), objective="dpo"
    )  # all-linear
    assert fresh.fused_layers.mlps and fresh.fused_layers.attention_groups  # the fused LoRA layers run
    loss, metrics = _step_zero(fresh, batch)
    assert loss == pytest.approx(math.log(2), rel=1e-7)
    assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0.0

    # with the adapter off, the fused layers give the base's own log-probabilities (full logits)
    _perturb_lora(fresh.model)
    with torch.no_grad(), fresh.reference_model():
        reference = pair_logps(fresh, batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    per_token = torch.log_softmax(logits[:, :-1].double(), -1).gather(2, labels.clamp(min=0)[..., None])
    expected = (per_token.squeeze(2) * (labels != IGNORE_INDEX)).sum(1)
    torch.testing.assert_close(
        torch.cat([reference.chosen, reference.rejected]).double(), expected, **TOLERANCE
    )
    assert not torch.allclose(pair_logps(fresh, batch).chosen, reference.chosen)  # the adapter was on

    # an "SFT" adapter (perturbed above) that moves the model away from its base
    sft = fresh.write_adapter(tmp_path / "sft")
    continued = InstructLoRAModule(
        model=str(tiny_model_dir), lora=LoRAConfig(), adapter=str(sft), objective="dpo"
    )
    before = {k: v.clone() for k, v in continued.trainable_state_dict().items()}
    loss, metrics = _step_zero(continued, batch)
    assert loss == pytest.approx(math.log(2), rel=1e-7)
    assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0.0
    after = continued.trainable_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the reference pass put them back
    # the reference is the SFT model, not the base: against the base, the rewards would not be 0
    with torch.no_grad(), continued.model.disable_adapter():
        base = pair_logps(continued, batch)
    with torch.no_grad():
        policy = pair_logps(continued, batch)
    assert not torch.allclose(base.chosen, policy.chosen)


def test_one_training_step_equals_trl_dpo_trainer(tiny_model_dir, tokenizer, pair_ids, tmp_path):  # noqa: F811
    theirs = _dpo_trainer(tiny_model_dir, tokenizer, tmp_path, loss_type=["sigmoid"], beta=0.1)
    _perturb_lora(theirs.model)
    layout = _layout(pair_ids, tokenizer.pad_token_id)
    trl_inputs = {k: layout[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    trl_loss = theirs._compute_loss(theirs.model, trl_inputs, return_outputs=False)
    trl_loss.backward()
    trl_metrics = {name: values[-1] for name, values in theirs._metrics["train"].items()}
    trl_grads = _lora_grads(theirs.model)

    ours = InstructLoRAModule(model=str(tiny_model_dir), lora=LORA, preference={"kind": "dpo", "beta": 0.1})
    lora_weights = {k: v for k, v in theirs.model.state_dict().items() if "lora_" in k}
    missing = ours.model.load_state_dict(lora_weights, strict=False)
    assert not missing.unexpected_keys and lora_weights
    ours.train()
    batch = {k: layout[k] for k in ("input_ids", "attention_mask", "labels")}
    loss_sum, sums, pairs, _ = pair_losses(ours, batch)
    (loss_sum / pairs).backward()  # what on_before_optimizer_step's factor makes of the summed loss
    metrics = dict(zip(ours.objective.metric_names, (sums / pairs).tolist(), strict=True))
    grads = _lora_grads(ours.model)

    torch.testing.assert_close(loss_sum / pairs, trl_loss.detach(), **TOLERANCE)
    assert 0 < metrics["rewards/accuracies"] < 1
    for name in REWARD_METRICS + LOGPS_METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    assert grads.keys() == trl_grads.keys() and grads
    for name, grad in trl_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOLERANCE)


class PreferenceGradCapture(GradCapture, InstructLoRAModule):
    """The gradients the optimizer is given, after the window's normalization."""


def test_accumulation_gives_the_gradient_of_the_mean_over_all_pairs(tiny_model_dir, pairs_file, tmp_path):
    """Micro-batches of 3 and 2 pairs (accumulated) against one batch of all 5: a mean of the two
    batches' means would weigh the pairs of the smaller one more."""
    runs = {}
    for batch_size, accumulate in [(5, 1), (3, 2)]:
        torch.manual_seed(0)
        module = PreferenceGradCapture(model=str(tiny_model_dir), lora=LORA, warmup_steps=0, objective="dpo")
        data = _data(tiny_model_dir, pairs_file, batch_size)
        recorder = Recorder()
        run = trainer(tmp_path, max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0)
        run.callbacks.append(recorder)
        run.fit(module, datamodule=data)
        runs[batch_size] = (module.captured, recorder.losses[-1])
    (one_batch, loss), (accumulated, accumulated_loss) = runs[5], runs[3]
    assert accumulated.keys() == one_batch.keys() and one_batch
    assert any(bool(g.abs().sum()) for g in one_batch.values())
    for name in one_batch:
        torch.testing.assert_close(accumulated[name], one_batch[name], atol=1e-7, rtol=1e-5, msg=name)
    assert accumulated_loss == pytest.approx(loss, rel=1e-6) and loss == pytest.approx(math.log(2), rel=1e-6)


class PreferenceFaulty(FaultyModule, InstructLoRAModule):
    """A NaN loss at chosen batches."""


def test_a_nan_step_is_skipped_and_a_resume_from_an_sft_adapter_is_exact(
    tiny_model_dir, pairs_file, tmp_path
):
    """From an SFT adapter (the reference is rebuilt from it on resume), batch 1's NaN loss skipped:
    the weights stay, and a run stopped at step 2 resumes onto the uninterrupted run's steps."""
    sft = InstructLoRAModule(model=str(tiny_model_dir), lora=LORA)
    _perturb_lora(sft.model)
    adapter = str(sft.write_adapter(tmp_path / "sft"))

    def run(root: Path, *callbacks, ckpt_path=None) -> Recorder:
        torch.manual_seed(0)
        module = PreferenceFaulty(
            model=str(tiny_model_dir), adapter=adapter, warmup_steps=0, nan_loss_at=(1,), objective="dpo"
        )
        data = _data(tiny_model_dir, pairs_file, batch_size=1)
        return recorded_fit(module, data, root, 4, SkipNonFiniteSteps(), *callbacks, ckpt_path=ckpt_path)

    uninterrupted = run(tmp_path / "a")
    weights = [state[0] for state in uninterrupted.states]
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])  # batch 1 skipped
    assert not all(torch.equal(weights[2][k], weights[1][k]) for k in weights[0])
    every_2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run(tmp_path / "b", every_2, StopAfter(2))
    resumed = run(tmp_path / "c", ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert_resumed_as_uninterrupted(resumed, uninterrupted, 2)


def test_settings_that_cannot_apply_are_refused(tiny_model_dir, pairs_file):
    with pytest.raises(
        ConfigError, match=r"model\.preference\.label_smoothing: applies to dpo and simpo, not kind: ipo"
    ):
        InstructLoRAModule(model=str(tiny_model_dir), preference=PreferenceConfig("ipo", label_smoothing=0.1))


@pytest.mark.parametrize(
    ("setting", "value", "why"),
    [
        ("packing", True, "pairs, labelled answers and rollouts are padded rows"),
        ("streaming", True, "pairs, labelled answers and prompts are read and split by prompt"),
        ("chatterbot_categories", ["ai"], "the chatterbot corpus holds conversations"),
        ("train_on", "all", "pairs, labelled answers and rollouts train their answers only"),
        ("multi_turn", "per_turn", "only each record's last answer is trained"),
        ("format", "chat", "the layouts of pairs, labelled answers and prompts are told apart per record"),
    ],
)
def test_settings_pairs_cannot_take_are_refused_naming_both(tiny_model_dir, pairs_file, setting, value, why):
    """By the rules table, when the data module is made (the CLI: when the config is read)."""
    with pytest.raises(ConfigError) as refused:
        InstructDataModule(
            batch_kind="pairs",
            tokenizer=str(tiny_model_dir),
            train_files=[str(pairs_file)],
            **{setting: value},
        )
    line = str(refused.value)
    assert line.startswith(f"data.{setting}: ") and "cannot be combined with model.objective" in line
    assert why in line


def test_a_source_of_another_format_is_refused_naming_it(tiny_model_dir, pairs_file):
    source = {"path": str(pairs_file), "format": "chat"}
    data = InstructDataModule(batch_kind="pairs", tokenizer=str(tiny_model_dir), sources=[source])
    with pytest.raises(
        ConfigError, match=r"data\.sources: .*pairs\.jsonl: format must be auto for preference"
    ):
        data.setup("fit")


def test_fit_with_the_dpo_config_writes_reward_metrics_and_an_adapter(
    tiny_model_dir, pairs_file, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    loggers = tmp_path / "loggers.yaml"
    csv_logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path), "name": ""},
    }
    wandb_logger = {
        "class_path": "lit_instruct.loggers.AutoWandbLogger",
        "init_args": {"save_dir": str(tmp_path)},
    }
    loggers.write_text(yaml.safe_dump({"trainer": {"logger": [csv_logger, wandb_logger]}}))
    args = ["fit", "--config", str(ROOT / "configs" / "dpo.yaml"), "--config", str(loggers)]
    args += ["--model.model", str(tiny_model_dir), "--data.train_files", f"[{pairs_file}]"]
    args += ["--data.val_fraction", "0.4", "--data.batch_size", "2", "--trainer.max_steps", "2"]
    args += ["--trainer.val_check_interval", "2", "--trainer.precision", "32-true"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    main(args)
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        table = list(csv.DictReader(rows))
    trained = [row for row in table if row["train/loss"]]
    validated = [row for row in table if row["val/loss"]]
    assert [row["step"] for row in trained] == ["1"] and len(validated) == 2  # log_every_n_steps: 2
    for name in REWARD_METRICS + LOGPS_METRICS:
        assert trained[0][f"train/{name}"] and all(row[f"val/{name}"] for row in validated)
    assert float(validated[0]["val/loss"]) == pytest.approx(math.log(2), rel=1e-6)  # before fit
    assert float(validated[0]["val/rewards/margins"]) == 0.0
    assert (tmp_path / "version_0" / "adapter" / "adapter_model.safetensors").is_file()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # W&B: the same values, TRL's names
    wandb.finish()  # the CLI's run, still open
    history = wandb_reader.settled_history(run_file, "val/loss", rows=len(validated))
    for split, rows in (("train", trained), ("val", validated)):
        for name in ["loss", *REWARD_METRICS, *LOGPS_METRICS]:
            logged = [row[f"{split}/{name}"] for row in history if f"{split}/{name}" in row]
            expected = [float(row[f"{split}/{name}"]) for row in rows]
            assert logged == pytest.approx(expected, rel=1e-6), f"{split}/{name}"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kind": "simpo", "use_weighting": True}, "use_weighting: applies to dpo and ipo"),
        ({"loss_type": ["aot"], "use_weighting": True}, "use_weighting: cannot weigh loss_type: aot"),
    ],
)
def test_wpo_weighting_is_refused_where_trl_has_none(settings, message) -> None:
    with pytest.raises(ConfigError, match=rf"model\.preference\.{message}"):
        PreferenceConfig(**settings).loss()
