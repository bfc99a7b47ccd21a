"""Preference training on the real SmolLM2-135M-Instruct against TRL's own trainers, one step.

Pairs of ``examples/data/preference_sample.jsonl`` rendered and batched by our
:class:`InstructDataModule`; TRL's ``DPOTrainer`` (sigmoid) and ``CPOTrainer`` (SimPO) get the same
token ids in their layouts, with the same LoRA weights. The loss, TRL's reward metrics and the LoRA
gradients after one backward of :class:`InstructLoRAModule`'s step must equal theirs (fp32, the
tolerance of the tiny-model tests in ``tests/test_preference_loss.py``, where every other DPO loss
type is compared). Also through the module: MPO's weighted loss types (the sft term), WPO's
weighting (``use_weighting``: each pair's loss times its answers' weights, from the squared norms of
the predicted distributions, which TRL's fused head computes from full logits) and LD-DPO's
``ld_alpha`` with ``reference_free`` (the weighted sums taken in the module, no reference pass; TRL:
a precomputed reference of zeros). Step 0 on SmolLM2 is ln 2
with zero rewards, fresh (the fused LoRA layers) and from an SFT adapter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import pair_losses
from tests.test_preference_loss import (
    LOGPS_METRICS,
    REWARD_METRICS,
    _compare,
    _dpo_trainer,
    _experimental_trainer,
    _lora_grads,
    _perturb_lora,
)

pytestmark = pytest.mark.e2e  # the real SmolLM2-135M-Instruct: `make test-fast` leaves it out

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "preference_sample.jsonl"
PAIRS = (11, 12, 16)  # lines of SAMPLE: short rows (37 to 43 tokens), answers of 2 to 9 tokens
NUM_PAIRS = len(PAIRS)
SCALE = 0.02  # LoRA B's spread: the policy moves off its reference, no loss saturates


@pytest.fixture(scope="module")
def smollm2_data(smollm2_path: Path) -> InstructDataModule:
    data = InstructDataModule(
        batch_kind="pairs",
        tokenizer=str(smollm2_path),
        train_files=[str(SAMPLE)],
        val_fraction=0.0,
        batch_size=NUM_PAIRS,
        max_seq_len=128,
    )
    data.setup("fit")
    return data


@pytest.fixture(scope="module")
def batch(smollm2_data: InstructDataModule) -> dict:
    """The sample's ``PAIRS`` as our module trains on them: ``[chosen rows; rejected rows]``."""
    pairs = smollm2_data.pairs("train")
    assert len(pairs) == len(SAMPLE.read_text().splitlines())  # none dropped: pair i is line i
    return smollm2_data._collator()([pairs[i] for i in PAIRS])


def _trl_dataset():
    """The same records as TRL's dataset (TRL tokenizes it at build; the step below gets our ids)."""
    from datasets import Dataset

    lines = SAMPLE.read_text().splitlines()
    rows = [json.loads(lines[i]) for i in PAIRS]
    return Dataset.from_dict({key: [row[key] for row in rows] for key in ("prompt", "chosen", "rejected")})


def _trl_step(
    case: str, model: Path, tokenizer, tmp_path: Path, batch: dict, targets: list[str], config: dict
):
    """TRL's loss, metrics and LoRA gradients on ``batch``'s ids, from random LoRA B matrices."""
    from peft import LoraConfig

    peft_targets = "all-linear" if targets == ["all-linear"] else targets  # peft's spelling: a string
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=peft_targets)
    config = dict(config)
    zero_reference = config.pop("precompute_ref_log_probs", False)  # given zeros below, not computed
    built = dict(dataset=_trl_dataset(), peft_config=lora, gradient_checkpointing=False, **config)
    if case == "dpo":
        trainer = _dpo_trainer(model, tokenizer, tmp_path, **built)
        trainer.precompute_ref_logps = zero_reference
    else:
        trainer = _experimental_trainer("cpo", model, tokenizer, tmp_path, **built)
    _perturb_lora(trainer.model, scale=SCALE)
    if case == "dpo":
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
        inputs["completion_mask"] = (batch["labels"] != IGNORE_INDEX).long()
        if zero_reference:
            inputs["ref_chosen_logps"] = inputs["ref_rejected_logps"] = torch.zeros(NUM_PAIRS)
        loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    else:
        sides = {"chosen": slice(0, NUM_PAIRS), "rejected": slice(NUM_PAIRS, None)}
        pair_batch = {
            f"{side}_{key}": batch[key][rows]
            for side, rows in sides.items()
            for key in ("input_ids", "attention_mask", "labels")
        }
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, pair_batch)
    loss.backward()
    lora_weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
    return loss.detach(), metrics, _lora_grads(trainer.model), lora_weights


def _our_step(module: InstructLoRAModule, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """One training step's loss as the optimizer sees it (the pairs' sum over their count), its
    backward, and the per-pair metrics' means."""
    module.train()
    loss_sum, sums, pairs, _ = pair_losses(module, batch)
    loss = loss_sum / pairs
    loss.backward()
    return loss.detach(), dict(zip(module.objective.metric_names, (sums / pairs).tolist(), strict=True))


CASES = {  # TRL's trainer, LoRA targets, its config, ours
    "dpo-sigmoid": (
        "dpo",
        ["all-linear"],
        dict(loss_type=["sigmoid"], beta=0.1),
        {"kind": "dpo", "beta": 0.1},
    ),
    "simpo": (
        "cpo",
        ["q_proj", "v_proj"],
        dict(loss_type="simpo", beta=2.0, simpo_gamma=0.6, cpo_alpha=0.0),
        {"kind": "simpo", "beta": 2.0, "gamma": 0.6},
    ),
    "wpo": (  # TRL 1.16 cannot weigh its "sft" term (an in-place product on an expanded tensor)
        "dpo",
        ["q_proj", "v_proj"],
        dict(loss_type=["sigmoid", "bco_pair"], beta=0.1, use_weighting=True),
        {"loss_type": ["sigmoid", "bco_pair"], "use_weighting": True},
    ),
    "ld-dpo-reference-free": (
        "dpo",
        ["q_proj", "v_proj"],
        dict(loss_type=["sigmoid"], beta=0.1, ld_alpha=0.5, precompute_ref_log_probs=True),
        {"ld_alpha": 0.5, "reference_free": True},
    ),
}
SLOW = {"wpo", "ld-dpo-reference-free"}  # the other DPO loss types (MPO...): on the tiny model only


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_one_step_on_smollm2_equals_trl(case, smollm2_path, tokenizer, batch, tmp_path):
    trainer_kind, targets, trl_config, preference = CASES[case]
    trl_loss, trl_metrics, trl_grads, lora_weights = _trl_step(
        trainer_kind, smollm2_path, tokenizer, tmp_path, batch, targets, trl_config
    )

    lora = LoRAConfig(r=8, alpha=16, target_modules=targets)
    ours = InstructLoRAModule(model=str(smollm2_path), lora=lora, preference=preference)
    if targets == ["all-linear"]:  # the fused LoRA layers, against TRL's peft forward
        fused = ours.fused_layers
        assert fused is not None and fused.mlps and fused.attention_groups and not fused.left_unfused
    loaded = ours.model.load_state_dict(lora_weights, strict=False)
    assert not loaded.unexpected_keys and lora_weights
    loss, metrics = _our_step(ours, batch)

    if not ours.objective.preference_loss.reference_free:  # zero reference: the policy's log-probs, all < 0
        assert 0 < metrics["rewards/accuracies"] < 1  # pairs the policy tells apart differently
    floor = 0.01 if preference.get("use_weighting") else 0.05  # WPO's weights (probabilities) shrink it
    assert floor < loss.item() < 5  # not saturated: the gradients are not vanishingly small
    names = REWARD_METRICS + LOGPS_METRICS
    _compare(trl_loss, trl_metrics, trl_grads, loss, metrics, _lora_grads(ours.model), names)


def _step_zero(module: InstructLoRAModule, batch: dict) -> tuple[float, dict[str, float]]:
    """The first step's loss and per-pair metrics' means (no backward)."""
    module.train()
    with torch.no_grad():
        loss_sum, sums, pairs, _ = pair_losses(module, batch)
    return (loss_sum / pairs).item(), dict(
        zip(module.objective.metric_names, (sums / pairs).tolist(), strict=True)
    )


def test_step_zero_on_smollm2_is_ln2_with_zero_rewards_fresh_and_from_an_sft_adapter(
    smollm2_path, batch, tmp_path
):
    """The reference being the base (fresh) or the SFT model (the SFT adapter's weights); that it is
    not the base then is checked on the tiny model (tests/test_preference_module.py)."""
    fresh = InstructLoRAModule(
        model=str(smollm2_path), lora=LoRAConfig(r=8, alpha=16), objective="dpo"
    )  # all-linear
    _perturb_lora(fresh.model, scale=SCALE)  # an "SFT" adapter, away from the base
    sft = fresh.write_adapter(tmp_path / "sft")
    with torch.no_grad():
        for name, parameter in fresh.model.named_parameters():
            if "lora_B" in name:
                parameter.zero_()  # fresh again: B = 0
    continued = InstructLoRAModule(
        model=str(smollm2_path), lora=LoRAConfig(), adapter=str(sft), objective="dpo"
    )
    for module in (fresh, continued):
        loss, metrics = _step_zero(module, batch)
        assert loss == pytest.approx(math.log(2), rel=1e-7)
        assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0.0
        assert metrics["rewards/accuracies"] == 0.0
