"""GRPO and RLOO through ``lit-instruct fit --config configs/grpo.yaml`` on the tiny model: prompts read
as the objective's batch kind, completions sampled by the policy, rewards, TRL's metrics logged, the
adapter written; and the mistakes refused in one line before any weight is read."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from lit_instruct.cli import main
from tests.test_mistakes import refused

ROOT = Path(__file__).resolve().parents[1]
SHORT = [  # a fit of two steps of 2 prompts x 2 completions of up to 6 tokens
    "--trainer.max_steps",
    "2",
    "--trainer.val_check_interval",
    "2",
    "--trainer.callbacks",
    json.dumps(
        [
            {
                "class_path": "lit_instruct.callbacks.RolloutSamples",
                "init_args": {"every_n_steps": 1, "max_rows": 3},
            }
        ]
    ),
    "--trainer.enable_progress_bar",
    "false",
    "--model.objective.init_args.max_completion_length",
    "6",
    "--model.objective.init_args.num_generations",
    "2",
    "--data.batch_size",
    "2",
    "--data.eval_batch_size",
    "2",
    "--data.val_fraction",
    "0.01",
]


def fit(model: Path, tmp_path: Path, *extra: str) -> list[dict]:
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path), "name": ""},
    }
    args = ["fit", "--config", str(ROOT / "configs" / "grpo.yaml"), "--model.model", str(model)]
    args += ["--trainer.logger", json.dumps(logger), "--trainer.default_root_dir", str(tmp_path)]
    args += ["--model.adapter_dir", str(tmp_path / "adapter"), *SHORT, *extra]
    main(args)
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        return list(csv.DictReader(rows))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_the_grpo_config_fits_and_logs_trls_metrics(
    objective, tiny_model_dir, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.chdir(ROOT)  # the config names its data relative to the repository
    extra = []
    if objective == "rloo":  # the config's settings RLOO shares carry over (jsonargparse): beta set
        extra = ["--model.objective", json.dumps({"class_path": "RLOO", "init_args": {"beta": 0.05}})]
    with caplog.at_level("INFO"):
        rows = fit(tiny_model_dir, tmp_path, *extra)
    report = caplog.text
    assert "best val/reward " in report and "best val/loss" not in report  # GRPO's monitor
    assert "sampling " in report and " completion tokens (" in report  # RolloutSamples' fit cost
    trained = [r for r in rows if r.get("train/loss")]
    validated = [r for r in rows if r.get("val/reward")]
    assert len(trained) == 2 and len(validated) == 2  # before the fit, and after its 2 steps
    for name in ("reward", "reward_std", "rewards/exact_answer/mean", "entropy", "completions/mean_length"):
        assert f"train/{name}" in trained[0] and trained[0][f"train/{name}"] != "", name
    assert 1 <= float(trained[0]["train/completions/mean_length"]) <= 6
    assert ("train/kl" in trained[0] and trained[0]["train/kl"] != "") == (objective == "rloo")  # RLOO's beta
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert objective in card
    rollouts = (tmp_path / "version_0" / "rollouts.md").read_text()  # RolloutSamples, each step
    assert "## step 1\n" in rollouts and "## step 2\n" in rollouts
    assert (
        rollouts.count("### completion") == 6 and "exact_answer 0.000" in rollouts and "advantage" in rollouts
    )


def test_grpo_on_pairs_is_one_line_naming_the_record(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    pairs = str(ROOT / "examples" / "data" / "preference_sample.jsonl")
    args = ["fit", "--config", str(ROOT / "configs" / "grpo.yaml"), "--model.model", str(tiny_model_dir)]
    line = refused([*args, "--data.train_files", f"[{pairs}]"], capsys)
    assert "preference_sample.jsonl:1: field 'chosen' holds an answer: GRPO and RLOO sample their own" in line


@pytest.mark.slow
@pytest.mark.parametrize("num_iterations, stop", [(1, 2), (2, 1)])
def test_a_resumed_grpo_fit_samples_and_trains_as_the_uninterrupted_one(
    num_iterations, stop, tiny_model_dir, tmp_path
) -> None:
    """Checkpointed mid-epoch and resumed: the next steps sample the same completions (seeds from
    the seed, step, micro-batch and rank, not from the RNG's history) and leave the same LoRA weights
    as the fit that ran through. With ``num_iterations: 2`` the checkpoint after step 1 is inside a
    rollout's iterations: the rollout (its old log-probs) comes back from the checkpoint and the data
    resumes inside the repeated window."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_instruct import InstructDataModule, InstructLoRAModule, LoRAConfig
    from lit_instruct.objectives import GRPO
    from tests.helpers import trainer

    def run(out: Path, ckpt_path: str | None = None) -> tuple[dict, list]:
        L.seed_everything(0)
        objective = GRPO(
            rewards=["exact_answer", {"class_path": "format", "init_args": {"pattern": "1"}}],
            num_generations=2,
            max_completion_length=6,
            temperature=1.0,
            num_iterations=num_iterations,
        )
        module = InstructLoRAModule(
            model=str(tiny_model_dir),
            lora=LoRAConfig(r=4, alpha=8, dropout=0.1),
            objective=objective,
            learning_rate=1e-2,
            warmup_steps=0,
            adapter_dir=str(out / "adapter"),
        )
        data = InstructDataModule(
            batch_kind="prompts",
            tokenizer=str(tiny_model_dir),
            train_files=[str(ROOT / "examples/data/arithmetic.jsonl")],
            batch_size=2,
            val_fraction=0.0,
        )
        every = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1)
        fitted = trainer(out, max_steps=3, enable_checkpointing=True, callbacks=[every], limit_val_batches=0)
        fitted.fit(module, datamodule=data, ckpt_path=ckpt_path)
        weights = {k: v.clone() for k, v in module.trainable_state_dict().items()}
        return weights, list(objective.last_rollout)

    through, rollout = run(tmp_path / "through")
    checkpoint = sorted((tmp_path / "through").glob(f"*step={stop}*.ckpt"))
    assert checkpoint, sorted(p.name for p in (tmp_path / "through").iterdir())
    resumed, resumed_rollout = run(tmp_path / "resumed", str(checkpoint[0]))
    assert [r["completion"] for r in resumed_rollout] == [r["completion"] for r in rollout]
    assert through.keys() == resumed.keys()
    for name, value in through.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_validation_inside_an_accumulation_window_leaves_the_rollouts_in_place(
    tiny_model_dir, tmp_path
) -> None:
    """``num_iterations: 2`` with 2 micro-batches a step and a validation after each micro-batch: the
    validation's own rollouts do not renumber the training micro-batches, so step 2 reuses each
    micro-batch's own rollout (the counter shared by both modes had the second step stop on "other
    prompts"), and every training micro-batch of step 1 sampled with its own seed."""
    from lit_instruct import InstructDataModule, InstructLoRAModule, LoRAConfig
    from lit_instruct.objectives import GRPO
    from tests.helpers import trainer

    seeds: list[tuple[bool, int]] = []

    class Seeds(GRPO):
        def _seed(self, policy, training, step, index, rank):
            seed = super()._seed(policy, training, step, index, rank)
            seeds.append((training, seed))
            return seed

    objective = Seeds(rewards=["exact_answer"], num_generations=2, max_completion_length=4, num_iterations=2)
    module = InstructLoRAModule(
        model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8), objective=objective, warmup_steps=0
    )
    data = InstructDataModule(
        batch_kind="prompts",
        tokenizer=str(tiny_model_dir),
        train_files=[str(ROOT / "examples/data/arithmetic.jsonl")],
        batch_size=2,
        eval_batch_size=2,
        val_fraction=0.05,
    )
    run = trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, val_check_interval=1, limit_val_batches=1)
    run.fit(module, datamodule=data)
    assert run.global_step == 2
    training = [seed for mode, seed in seeds if mode]
    assert len(training) == 2 and len(set(training)) == 2  # step 1's two micro-batches, step 2 reused them
    assert any(not mode for mode, _ in seeds)  # validations ran inside the window
