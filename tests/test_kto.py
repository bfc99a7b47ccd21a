"""KTO (lit_instruct.objectives.kto) against TRL 1.16's own ``KTOTrainer``, one step on the real
SmolLM2-135M-Instruct: the same answers (three pairs of ``examples/data/preference_sample.jsonl``
unpaired: each chosen answer desirable, each rejected one not, in TRL's conversational unpaired
layout) read and batched by our ``InstructDataModule(batch_kind="unpaired")`` give TRL's own token ids,
masks and KL rows; on those, with the same LoRA weights, the loss, TRL's metrics and every LoRA
gradient equal TRL's (fp32, the tolerance of the DPO tests), for ``kto`` (β 1: the KL estimate moves
the loss) and ``apo_zero_unpaired``, and for a batch of desirable answers only."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.objectives import KTO
from lit_instruct.train.module import InstructLoRAModule
from tests.test_preference_loss import _load, _lora_grads, _perturb_lora

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "preference_sample.jsonl"
PAIRS = (11, 12, 16)  # lines of SAMPLE: short rows, answers of 2 to 9 tokens (as the DPO test's)
SCALE = 0.02
TARGETS = ["q_proj", "v_proj"]
TEMPLATE_TAIL = "\n"
"""What SmolLM2's ChatML template renders after an answer's ``<|im_end|>``."""
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def unpaired_rows() -> list[dict]:
    """The pairs' answers in TRL's conversational unpaired layout: chosen (true), then rejected."""
    lines = SAMPLE.read_text().splitlines()
    rows = []
    for index in PAIRS:
        pair = json.loads(lines[index])
        prompt = [{"role": "user", "content": pair["prompt"]}]
        for side, label in (("chosen", True), ("rejected", False)):
            rows.append(
                {
                    "prompt": prompt,
                    "completion": [{"role": "assistant", "content": pair[side]}],
                    "label": label,
                }
            )
    return rows


def our_batch(model: Path, rows: list[dict], tmp_path: Path) -> dict:
    path = tmp_path / "unpaired.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = InstructDataModule(
        batch_kind="unpaired",
        tokenizer=str(model),
        train_files=[str(path)],
        val_fraction=0.0,
        batch_size=len(rows),
        max_seq_len=128,
        deduplicate=False,
    )
    data.setup("fit")
    answers = data.pairs("train")
    assert len(answers) == len(rows)
    return data._collator()(list(answers))


def trl_trainer(model: Path, tokenizer, rows: list[dict], tmp_path: Path, **config):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=len(rows),
        max_length=128,
        **config,
    )
    dataset = Dataset.from_list(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(
            model=_load(model),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
        )
    trainer.model.train()
    _perturb_lora(trainer.model, scale=SCALE)
    return trainer


def trl_inputs(batch: dict) -> dict:
    """Our batch in TRL's layout: the answer rows, then the KL rows, with completion masks."""
    n = len(batch["desirable"])
    inputs = {"label": batch["desirable"]}
    for prefix, rows in (("", slice(0, n)), ("KL_", slice(n, 2 * n))):
        inputs[f"{prefix}input_ids"] = batch["input_ids"][rows]
        inputs[f"{prefix}attention_mask"] = batch["attention_mask"][rows]
        inputs[f"{prefix}completion_mask"] = (batch["labels"][rows] != IGNORE_INDEX).long()
    return inputs


def assert_same_rows(ours: dict, theirs: dict, tokenizer) -> None:
    """The same real tokens per row (padding aside), and the same completion masks but for what TRL
    adds past the answer's end-of-turn token: the template's text after it (ChatML's newline), which
    TRL scores as completion and we do not (as for pairs and SFT)."""
    for prefix in ("", "KL_"):
        for k in range(len(theirs["label"])):
            real = theirs[f"{prefix}attention_mask"][k].bool()
            mine = ours[f"{prefix}attention_mask"][k].bool()
            ids = ours[f"{prefix}input_ids"][k][mine]
            assert torch.equal(ids, theirs[f"{prefix}input_ids"][k][real]), (prefix, k)
            our_mask = ours[f"{prefix}completion_mask"][k][mine].bool()
            trl_mask = theirs[f"{prefix}completion_mask"][k][real].bool()
            last = int(our_mask.nonzero().max())
            assert torch.equal(our_mask[: last + 1], trl_mask[: last + 1]), (prefix, k)
            assert trl_mask[last + 1 :].all() and not our_mask[last + 1 :].any(), (prefix, k)
            assert TEMPLATE_TAIL.startswith(tokenizer.decode(ids[last + 1 :])), (prefix, k)
    assert torch.equal(ours["label"], theirs["label"].bool())


CASES = {
    "kto-beta-1": (dict(beta=1.0, loss_type="kto"), slice(None)),
    "apo-zero-unpaired": (dict(beta=0.1, loss_type="apo_zero_unpaired"), slice(None)),
    "kto-desirable-only": (dict(beta=1.0, desirable_weight=1.3, undesirable_weight=0.7), slice(0, None, 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_one_step_on_smollm2_equals_trls_kto_trainer(case, smollm2_path, tokenizer, tmp_path):
    settings, rows_taken = CASES[case]
    rows = unpaired_rows()[rows_taken]
    trainer = trl_trainer(smollm2_path, tokenizer, rows, tmp_path, **settings)
    batch = our_batch(smollm2_path, rows, tmp_path)
    inputs = trl_inputs(batch)
    if settings.get("loss_type") == "kto":  # TRL's own tokenization and KL pairing give our rows
        assert_same_rows(inputs, next(iter(trainer.get_train_dataloader())), tokenizer)
    trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    trl_loss.backward()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    trl_grads = _lora_grads(trainer.model)
    lora_weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}

    ours = InstructLoRAModule(
        model=str(smollm2_path),
        lora=LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
        objective=KTO(**settings),
    )
    loaded = ours.model.load_state_dict(lora_weights, strict=False)
    assert not loaded.unexpected_keys and lora_weights
    ours.train()
    sums = ours.objective_sums(batch)
    loss = sums.loss_sum / sums.count
    loss.backward()
    metric_sums = dict(zip(ours.objective.metric_names, sums.metric_sums.tolist(), strict=True))
    metrics = ours.objective.metrics(metric_sums, sums.count)
    assert sums.count == len(rows)
    names = [name for name in METRICS if name in trl_metrics]
    assert sorted(names) == sorted(metrics)  # the same metrics logged (one side only: no margins)
    if settings.get("loss_type") == "kto":
        assert trl_metrics["kl"] > 0.01  # the KL estimate is in play
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)
    for name in names:  # as the DPO tests bound them: a reward's rounding is absolute (sums of logps)
        tolerance = dict(rel=1e-5, abs=1e-5 if name.startswith(("rewards/", "kl")) else 1e-6)
        assert metrics[name] == pytest.approx(trl_metrics[name], **tolerance), name
    grads = _lora_grads(ours.model)
    assert grads.keys() == trl_grads.keys() and grads
    for name, grad in trl_grads.items():
        # fp32 sums in another order (chunked lm_head vs TRL's full logits): within 1e-5 of the
        # tensor's largest entry (β 1 makes them ten times the DPO test's, whose bound is 1e-6)
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))


def test_kto_settings_are_checked_before_weights(tiny_model_dir) -> None:
    with pytest.raises(ConfigError, match=r"model\.objective\.init_args\.beta: must be > 0"):
        KTO(beta=0)
    with pytest.raises(ConfigError, match=r"model\.objective\.init_args\.loss_type: 'bco' is none of"):
        KTO(loss_type="bco")
    with pytest.raises(ConfigError, match=r"model\.packing: must be false with model\.objective: kto"):
        InstructLoRAModule(model=str(tiny_model_dir), objective="kto", packing=True)
    with pytest.raises(ConfigError, match=r"data\.batch_size: 1 cannot be combined with model\.objective"):
        InstructDataModule(
            batch_kind="unpaired", tokenizer=str(tiny_model_dir), train_files=["x"], batch_size=1
        )


@pytest.mark.e2e
@pytest.mark.slow
def test_the_kto_config_trains_and_its_held_out_margin_rises(
    smollm2_path, tmp_path, monkeypatch, capsys
) -> None:
    """``lit-instruct fit --config configs/kto.yaml`` (6 steps): the held-out answers' reward margin
    rises from 0 (the policy is its reference before training) and their loss falls from 0.5."""
    from lit_instruct.cli import main

    monkeypatch.chdir(ROOT)  # the config names its data relative to the repository
    csv_logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path), "name": ""},
    }
    args = ["fit", "--config", "configs/kto.yaml", "--trainer.logger", json.dumps(csv_logger)]
    args += [
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "6",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.callbacks",
        "null",
    ]
    args += ["--trainer.enable_progress_bar", "false", "--model.adapter_dir", str(tmp_path / "adapter")]
    main(args)
    with open(tmp_path / "version_0" / "metrics.csv", encoding="utf-8") as rows:
        validated = [row for row in csv.DictReader(rows) if row.get("val/loss")]
    before, after = validated[0], validated[-1]
    assert float(before["val/loss"]) == pytest.approx(0.5) and float(before["val/rewards/margins"]) == 0.0
    assert float(after["val/rewards/margins"]) > 0.2 and float(after["val/loss"]) < 0.48
    assert float(after["val/answers"]) == 10
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "kto" in card
