"""Preference training (DPO) on 2 CPU processes (gloo) against one process with accumulation over the
same global batches: DDP and FSDP give the gradient of the mean over every pair of the step, through an
epoch's uneven last batch (a rank whose share is a padding repeat counts no pair) and a NaN on one
rank (skipped on both), with the same ``train/`` and ``val/`` metrics, also with the reference
log-probabilities computed once before training (``precompute_reference``: shared out over the ranks,
one of them computing a padding repeat; then no step runs a reference pass). From an SFT adapter under FSDP
the reference is that adapter, sharded as the parameters are: step 1 is ln 2 with zero rewards, and a
resumed run keeps it (not the checkpoint's trained weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.preference_ddp_fit import fit, results, start_two_processes
from tests.test_preference_loss import _perturb_lora

ANSWERS = ["Yes.", "No", " ".join(["a very long answer"] * 12), "Four.", "A medium answer, of some words."]
VAL = [
    ("Name a colour.", "Green.", "A colour, I think, like the grass is."),
    ("3 times 3?", "Nine.", "Six"),
    ("Say hi.", "Hi!", "Goodbye, and see you later."),
]


def _write_pairs(path: Path, rows: list[tuple[str, str, str]]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    return str(path)


@pytest.fixture
def args(tiny_model_dir: Path, tmp_path: Path) -> dict:
    """5 training pairs (answers of 1 to ~50 tokens): on 2 ranks of batch 2, an epoch's second step
    holds one pair and a padding repeat. 3 validation pairs: one rank validates a repeat too."""
    train = [(f"Question {i}?", a, ANSWERS[(i + 2) % len(ANSWERS)]) for i, a in enumerate(ANSWERS)]
    prompts_train, prompts_val = tmp_path / "prompts.jsonl", tmp_path / "prompts_val.jsonl"
    prompts_train.write_text("".join(json.dumps({"prompt": p, "answer": c}) + "\n" for p, c, _ in train))
    prompts_val.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _, _ in VAL))
    return {
        "model": str(tiny_model_dir),
        "train": _write_pairs(tmp_path / "train.jsonl", train),
        "val": _write_pairs(tmp_path / "val.jsonl", VAL),
        "prompts_train": str(prompts_train),
        "prompts_val": str(prompts_val),
    }


def assert_close_metrics(got: dict[str, float], expected: dict[str, float], where: str) -> None:
    assert got.keys() == expected.keys(), where
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{where}: {name}"


def assert_same_training(ranks: list[dict], one: dict, weight_atol: float = 1e-7) -> None:
    """Every rank logged one process's ``train/`` metrics at every step and its ``val/`` metrics at
    every validation (where it validated), gave the optimizer its LoRA gradients and held its weights
    after every step."""
    assert one["weights"][-1]
    for rank in ranks:
        assert len(rank["steps"]) == len(one["steps"])
        for step, (got, expected) in enumerate(zip(rank["steps"], one["steps"], strict=True), 1):
            assert_close_metrics(got, expected, f"step {step}")
        assert [s for s, _ in rank["validations"]] == [s for s, _ in one["validations"]]
        for (step, got), (_, expected) in zip(rank["validations"], one["validations"], strict=True):
            assert "val/loss" in expected
            assert_close_metrics(got, expected, f"validation at step {step}")
        for what in ("grads", "weights"):  # the gradient of the mean over the step's pairs, all ranks
            assert len(rank[what]) == len(one[what]) == len(one["steps"])
            for step, (got, expected) in enumerate(zip(rank[what], one[what], strict=True), 1):
                assert got.keys() == expected.keys()
                for name, value in expected.items():
                    where = f"{what} after step {step}, {name}"
                    atol = weight_atol if what == "weights" else 1e-7
                    torch.testing.assert_close(
                        got[name], value, atol=atol, rtol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
                    )


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_lora", "fsdp_lora"])
def test_dpo_on_two_ranks_equals_one_process_accumulating(strategy, args, tmp_path) -> None:
    """The reference: the adapter switched off. Each epoch: a step of 4 pairs, then one of the last
    pair (rank 1 holding only a repeat). Step 2's loss is NaN on rank 1 (one process: in both its
    micro-batches), skipped on both ranks. The ranks then fit again (same processes) with the
    reference precomputed: 5 training pairs in 2 forwards of 2 a rank (rank 1's second a repeat of
    pair 1), 3 held-out pairs in one (rank 1's holding a repeat); the same training as the one
    process running the reference in every step, and no reference pass in the steps."""
    args |= {"max_steps": 4, "strategy": strategy}
    two = {**args, "out": str(tmp_path / "two"), "nan_loss_at": [1], "fault_rank": 1, "then_precompute": True}
    processes = start_two_processes(two)  # they load while one process trains
    one = fit(
        {**args, "out": str(tmp_path / "one"), "nan_loss_at": [1]}, devices=1, accumulate_grad_batches=2
    )
    ranks = results(processes, two)

    assert [(r["world"], r["skipped"]) for r in ranks] == [(2, 1), (2, 1)] and one["skipped"] == 1
    assert [s["pairs"] for s in one["steps"]] == [4, 1, 4, 1]
    assert one["steps"][0]["loss"] != pytest.approx(math.log(2))  # the adapter on: not its reference
    weights = one["weights"]
    assert [bool(g) for g in one["grads"]] == [True, False, True, True]  # a skipped step: none
    assert not _changed(weights[0], weights[1]) and _changed(weights[1], weights[2])
    assert _changed(weights[2], weights[3])
    assert_same_training(ranks, one)
    micro_batches = 4 + len(one["validations"])  # a rank's: 4 steps of 1, a validation batch each
    assert [(r["reference_passes"], r["step_reference_passes"]) for r in ranks] == [(micro_batches,) * 2] * 2

    precomputed = [rank["precomputed"] for rank in ranks]
    assert [(r["world"], r["skipped"]) for r in precomputed] == [(2, 1), (2, 1)]
    assert [(r["reference_passes"], r["step_reference_passes"]) for r in precomputed] == [(3, 0), (3, 0)]
    assert_same_training(precomputed, one)


@pytest.mark.slow
def test_fsdp_from_an_sft_adapter_starts_at_ln2_and_resumes_against_it(args, tmp_path) -> None:
    """Continuing from an SFT adapter under ``fsdp_lora`` (rank 1 built on the meta device): step 1's
    loss is ln 2 with zero rewards on both ranks, the training is one process's, and a run resumed
    from step 1's checkpoint takes the same step 2 (its reference still the SFT adapter)."""
    sft = InstructLoRAModule(model=args["model"], lora=LoRAConfig(r=4, alpha=8))
    _perturb_lora(sft.model)  # away from the base: a reference that were the base would show
    args |= {"adapter": str(sft.write_adapter(tmp_path / "sft")), "max_steps": 2, "strategy": "fsdp_lora"}
    two = {**args, "out": str(tmp_path / "two"), "ckpt_every": 1, "resume_at": 1, "low_memory_load": True}
    processes = start_two_processes(two)
    one = fit({**args, "out": str(tmp_path / "one")}, devices=1, accumulate_grad_batches=2)
    ranks = results(processes, two)

    assert [(r["world"], r["built_on_meta"]) for r in ranks] == [(2, False), (2, True)]
    for rank in ranks:
        first = rank["steps"][0]
        assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
        assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert [s["pairs"] for s in one["steps"]] == [4, 1]
    assert_same_training(ranks, one)

    for rank in ranks:  # resumed from step 1's checkpoint: step 2 again
        resumed = rank["resumed"]
        assert len(resumed["steps"]) == 1
        assert_close_metrics(resumed["steps"][0], rank["steps"][1], "resumed step 2")
        for name, value in rank["weights"][1].items():
            torch.testing.assert_close(resumed["weights"][0][name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp_lora"])  # under DDP: test_kto_on_two_ranks_estimates_kl_over_both
def test_kto_on_two_ranks_equals_one_process_accumulating(strategy, args, tmp_path) -> None:
    """KTO's ``apo_zero_unpaired`` on the 5 pairs read as 10 answers (2 a rank a micro-batch): the
    gradient of the mean over every answer of the step, the same ``train/`` and ``val/`` metrics
    (TRL's: ``rewards/chosen``... over each side's answers), through a NaN on one rank, as one
    process accumulating over the same micro-batches (each micro-batch's KL rows pair its own answers)."""
    args |= {"max_steps": 3, "strategy": strategy, "objective": "kto-apo"}
    two = {**args, "out": str(tmp_path / "two"), "nan_loss_at": [1], "fault_rank": 1}
    processes = start_two_processes(two)
    one = fit(
        {**args, "out": str(tmp_path / "one"), "nan_loss_at": [1]}, devices=1, accumulate_grad_batches=2
    )
    ranks = results(processes, two)
    assert [(r["world"], r["skipped"]) for r in ranks] == [(2, 1), (2, 1)] and one["skipped"] == 1
    assert [s["answers"] for s in one["steps"]] == [4, 4, 2]
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "kl"} <= one["steps"][0].keys()
    # the gradients to 1e-7 as DPO's; AdamW divides an element's first moment by the root of its
    # second, so where both are ~1e-8 (an answer-free padding step) a 1e-9 difference in the
    # all-reduced sum moves that weight by up to ~1e-6: 1e-4 of one step's update (lr 1e-2)
    assert_same_training(ranks, one, weight_atol=1e-5)


@pytest.mark.slow
def test_kto_on_two_ranks_estimates_kl_over_both(args, tmp_path) -> None:
    """With its KL estimate (the mean over both ranks' KL rows, clamped: TRL's gathered estimate),
    both ranks log the same ``kl``, loss and metrics and hold the same weights after every step."""
    args |= {"max_steps": 2, "objective": "kto"}
    ranks = results(
        start_two_processes({**args, "out": str(tmp_path / "two")}), args | {"out": str(tmp_path / "two")}
    )
    first, second = ranks
    assert first["steps"] == second["steps"] and all(step["kl"] >= 0 for step in first["steps"])
    for mine, theirs in zip(first["weights"], second["weights"], strict=True):
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_lora", "fsdp_lora"])
def test_grpo_on_two_ranks_equals_one_process_accumulating(strategy, args, tmp_path) -> None:
    """GRPO (``dapo``, a KL term, ``num_iterations`` 2) on 5 prompts x 2 completions (2 prompts a
    rank a micro-batch, each prompt's group whole on its rank, padding repeats counting nothing): the
    gradient of the mean over every completion token of the step on both ranks, TRL's metrics
    (``reward``, ``reward_std`` over all ranks' completions...), each rollout trained for two steps
    (the data repeats each window on each rank), through a NaN on one rank, as one process
    accumulating. Under FSDP the completions are sampled from the sharded policy itself (every
    decoding step gathers the weights: the ranks decode in step until both have stopped), and they
    are the ones the single process samples for the same prompts (seeded by the micro-batch's place
    in the step's global batches); the held-out batches differ in make-up, so it validates none."""
    args |= {"max_steps": 4, "objective": "grpo", "num_iterations": 2, "strategy": strategy}
    if strategy == "fsdp_lora":
        args |= {"sample": True, "validate": False}
    two = {**args, "out": str(tmp_path / "two"), "nan_loss_at": [1], "fault_rank": 1}
    processes = start_two_processes(two)
    one = fit(
        {**args, "out": str(tmp_path / "one"), "nan_loss_at": [1]}, devices=1, accumulate_grad_batches=2
    )
    ranks = results(processes, two)
    assert [(r["world"], r["skipped"]) for r in ranks] == [(2, 1), (2, 1)] and one["skipped"] == 1
    assert {"reward", "reward_std", "kl", "entropy", "rewards/length_reward/mean"} <= one["steps"][0].keys()
    assert one["steps"][0]["reward_std"] > 0
    steps = one["steps"]
    assert len(steps) == 4
    assert steps[2]["completion_tokens"] < steps[0]["completion_tokens"]  # the epoch's last prompt
    assert one["steps"][1]["clip_ratio/region_mean"] > 0 or one["steps"][3]["clip_ratio/region_mean"] > 0
    assert_same_training(ranks, one, weight_atol=1e-5)
