"""GRPO's and RLOO's loss on a batch of rollouts (lit_instruct.objectives.rollout_loss) against TRL
1.16's own ``GRPOTrainer._compute_loss`` and ``RLOOTrainer._compute_loss``: the same completions,
advantages, old and reference log-probabilities (off-policy, so that ratios clip) and LoRA weights
give the same loss, TRL's metrics and every LoRA gradient (fp32), for each ``loss_type``, GSPO's
sequence-level ratios, two-sided clipping (``delta``), the KL term and a sampling temperature."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.loss.grpo import group_advantages, leave_one_out_advantages
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.objectives.base import ObjectiveSums
from lit_instruct.objectives.rollout_loss import (
    METRIC_NAMES,
    GRPOLossSettings,
    RLOOLossSettings,
    grpo_sums,
    rloo_sums,
    rollout_metrics,
)
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import trl_online_trainer
from tests.test_preference_loss import _lora_grads

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
PROMPTS = ["What is 12 + 7?", "Name a colour."]
COMPLETIONS = ["19.", "It is 19, I think, or maybe 20.", "Blue", "Red, green and a very pale shade of blue."]
MASKED = 3
"""The completion whose mask is all zero (a truncated completion masked away)."""
LORA = LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
TRL_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _reward(prompts, completions, **kwargs) -> list[float]:  # TRL needs one; the tests inject advantages
    return [0.0] * len(completions)


def trl_trainer(kind: str, model: Path, tokenizer, tmp_path: Path, **config):
    rows = [{"prompt": p} for p in PROMPTS]
    return trl_online_trainer(kind, model, tokenizer, tmp_path, _reward, rows, len(COMPLETIONS), 16, **config)


def completion_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(c)["input_ids"] + [tokenizer.eos_token_id] for c in COMPLETIONS]


def rollouts(tokenizer) -> dict[str, torch.Tensor]:
    """TRL's layout: left-padded prompts (each twice), right-padded completions and their masks."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    completions = completion_ids(tokenizer)
    width_p, width_c = max(map(len, prompt_ids)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    prompt = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompt_ids])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompt_ids])
    completion = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    completion_mask[MASKED] = 0
    return {
        "prompt_ids": prompt,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "completion_mask": completion_mask,
    }


def our_batch(theirs: dict[str, torch.Tensor], completions: list[list[int]]) -> dict[str, torch.Tensor]:
    """The same rollouts right-padded as one sequence each (prompt, completion), the completion
    tokens labelled (none of the masked one's), the per-token values flat in row-major order."""
    rows, labels = [], []
    for k, completion in enumerate(completions):
        prompt = theirs["prompt_ids"][k][theirs["prompt_mask"][k].bool()].tolist()
        scored = k != MASKED
        rows.append(prompt + completion)
        labels.append(
            [IGNORE_INDEX] * len(prompt) + (completion if scored else [IGNORE_INDEX] * len(completion))
        )
    width = max(map(len, rows))
    batch = {
        "input_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for lab in labels]),
        "advantages": theirs["advantages"],
    }
    mask = theirs["completion_mask"].bool()
    for ours_name, trl_name in (
        ("old_logps", "old_per_token_logps"),
        ("reference_logps", "ref_per_token_logps"),
    ):
        if trl_name in theirs:
            batch[ours_name] = theirs[trl_name][mask]
    return batch


def run_theirs(trainer, inputs: dict[str, torch.Tensor]) -> tuple[float, dict[str, float], dict]:
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), metrics, _lora_grads(trainer.model)


def run_ours(module: InstructLoRAModule, batch: dict, sums_of) -> tuple[float, dict[str, float], dict]:
    module.train()
    sums: ObjectiveSums = sums_of(module, batch)
    (sums.loss_sum / sums.count).backward()
    assert sums.metric_sums is not None
    named = dict(zip(METRIC_NAMES, sums.metric_sums.tolist(), strict=True))
    return (sums.loss_sum / sums.count).item(), named, _lora_grads(module.model)


def ours_like(theirs, model: Path) -> InstructLoRAModule:
    module = InstructLoRAModule(model=str(model), lora=LORA)
    weights = {k: v for k, v in theirs.model.state_dict().items() if "lora_" in k}
    loaded = module.model.load_state_dict(weights, strict=False)
    assert not loaded.unexpected_keys and weights
    return module


def assert_same_grads(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    scale = max(g.abs().max() for g in theirs.values())
    assert scale > 0
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.fixture
def trl_inputs(tokenizer) -> dict[str, torch.Tensor]:
    inputs = rollouts(tokenizer)
    inputs["advantages"] = torch.tensor([1.3, -0.7, -1.1, 0.9])
    return inputs


def off_policy(trainer, inputs: dict, seed: int, scale: float) -> torch.Tensor:
    """The current policy's log-probabilities (TRL's) moved by noise: what an older policy or the
    reference gave."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, mask, inputs["completion_ids"].size(1)
        )
    noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(seed)) * scale
    shift = torch.tensor([-2.0, 2.0, 0.0, 0.0])[:, None] * scale  # whole completions clip too (GSPO)
    return logps + noise + shift


GRPO_CASES = {
    "dapo": dict(loss_type="dapo"),
    "grpo-kl": dict(loss_type="grpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, use_bias_correction_kl=False),
    "bnpo-asymmetric": dict(loss_type="bnpo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "delta": dict(loss_type="dapo", delta=1.1, epsilon=0.1),
    "temperature": dict(loss_type="dapo", temperature=0.7, beta=0.04),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_loss_metrics_and_gradients_equal_trls(case, tiny_model_dir, tokenizer, trl_inputs, tmp_path):
    config = dict(GRPO_CASES[case])
    theirs = trl_trainer("grpo", tiny_model_dir, tokenizer, tmp_path, **config)
    inputs = dict(trl_inputs)
    inputs["old_per_token_logps"] = off_policy(theirs, inputs, seed=1, scale=0.15)
    if config.get("beta"):
        inputs["ref_per_token_logps"] = off_policy(theirs, inputs, seed=2, scale=0.3)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    trl_loss, trl_metrics, trl_grads = run_theirs(theirs, inputs)

    ours = ours_like(theirs, tiny_model_dir)
    settings = GRPOLossSettings(max_completion_length=16, **config)
    loss, sums, grads = run_ours(
        ours, our_batch(inputs, completion_ids(tokenizer)), lambda m, b: grpo_sums(m, b, settings)
    )
    metrics = rollout_metrics(sums, sequence_clips=settings.importance_sampling_level == "sequence")
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    for name in TRL_METRICS:
        if name in trl_metrics:
            assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name
    assert ("kl" in trl_metrics) == bool(config.get("beta"))
    assert trl_metrics["clip_ratio/region_mean"] > 0, "no ratio clipped: the case tests less than it says"
    assert_same_grads(grads, trl_grads)


def test_rloo_loss_metrics_and_gradients_equal_trls(tiny_model_dir, tokenizer, trl_inputs, tmp_path):
    theirs = trl_trainer("rloo", tiny_model_dir, tokenizer, tmp_path, beta=0.0, epsilon=0.1)
    inputs = dict(trl_inputs)
    old = off_policy(theirs, inputs, seed=1, scale=0.05)
    inputs["old_logps"] = (old * inputs["completion_mask"]).sum(1)
    trl_loss, trl_metrics, trl_grads = run_theirs(theirs, inputs)

    ours = ours_like(theirs, tiny_model_dir)
    batch = our_batch(inputs, completion_ids(tokenizer))
    batch["old_logps"] = old[inputs["completion_mask"].bool()]
    settings = RLOOLossSettings(epsilon=0.1)
    loss, sums, grads = run_ours(ours, batch, lambda m, b: rloo_sums(m, b, settings))
    metrics = rollout_metrics(sums, sequence_clips=True)
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name
    assert trl_metrics["clip_ratio/region_mean"] > 0
    assert_same_grads(grads, trl_grads)


def _trl_group_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> torch.Tensor:
    """TRL's own arithmetic (``GRPOTrainer._generate_and_score_completions``), as its helpers give it."""
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    std = nanstd(rewards).expand_as(rewards) if scale == "batch" else nanstd(grouped, dim=1)
    std = std if scale == "batch" else std.repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls_and_leave_out_unscored_rewards(scale) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, float("nan"), 0.0])
    ours = group_advantages(rewards, 4, scale)
    torch.testing.assert_close(ours.values, _trl_group_advantages(rewards, 4, scale))
    assert ours.values[3] == 0 and ours.values[10] == 0  # unscored: no signal
    if scale == "group":
        assert ours.zero_std.tolist()[4:8] == [True] * 4 and not ours.zero_std[:4].any()
        # by hand: the first group's scored rewards 1, 0, 0.5 have mean 0.5, unbiased std 0.5
        assert ours.values[0].item() == pytest.approx(0.5 / (0.5 + 1e-4))


def test_leave_one_out_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 2.0, 6.0, float("nan"), 3.0, 3.0])
    ours = leave_one_out_advantages(rewards, 3, normalize=False)
    expected = [1 - 4, 2 - 3.5, 6 - 1.5, 0.0, 0.0, 0.0]  # the second group: one scored sibling each
    assert ours.tolist() == pytest.approx(expected)
    normalized = leave_one_out_advantages(rewards, 3, normalize=True)
    scored = torch.tensor([*expected[:3], expected[4], expected[5]])
    assert math.isclose(
        normalized[0].item(), ((scored[0] - scored.mean()) / (scored.std() + 1e-4)).item(), rel_tol=1e-6
    )
    with pytest.raises(ValueError, match="num_generations >= 2"):
        leave_one_out_advantages(rewards, 4, normalize=False)
