"""Every response token weighs the same: across gradient accumulation, ranks, and loss implementations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.train.module import InstructLoRAModule
from tests.ddp_fit import run_ddp_fit
from tests.helpers import GradCapture, Recorder, make, trainer

ANSWERS = ["Yes.", "No", " ".join(["a very long answer"] * 30), "Four.", " ".join(["medium answer"] * 8)] * 2


@pytest.fixture
def uneven_file(tmp_path: Path) -> Path:
    """Answers from 1 to ~120 tokens long: a mean of means would weigh them very differently."""
    path = tmp_path / "uneven.jsonl"
    rows = [{"prompt": f"Question {i}?", "completion": answer} for i, answer in enumerate(ANSWERS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def token_weighted_loss(module: InstructLoRAModule, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """sum(CE) / count over all response-token predictions, from the full logits of the base model."""
    total, count = torch.zeros(()), 0
    for batch in batches:
        logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def test_accumulation_gives_the_gradient_of_one_batch_with_all_samples(tiny_model_dir, uneven_file, tmp_path):
    runs = {}
    for batch_size, accumulate in [(1, 4), (4, 1), (2, 2)]:
        module, data = make(tiny_model_dir, uneven_file, GradCapture, batch_size=batch_size)
        recorder = Recorder()
        run = trainer(tmp_path, max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0)
        run.callbacks.append(recorder)
        run.fit(module, datamodule=data)
        runs[batch_size] = (module.captured, recorder.losses[-1], data)

    one_batch, loss, data = runs[4]
    counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in data.train_dataloader()][:1]
    assert counts[0] > 40  # the long answer is in the window
    for batch_size in (1, 2):
        grads, accumulated_loss, _ = runs[batch_size]
        assert grads.keys() == one_batch.keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], one_batch[name], atol=1e-6, rtol=0, msg=name)
        assert accumulated_loss == pytest.approx(loss, rel=1e-6)

    module, data = make(tiny_model_dir, uneven_file, batch_size=1)
    data.setup("fit")
    micro_batches = [batch for _, batch in zip(range(4), data.train_dataloader(), strict=False)]
    module.model.eval()
    with torch.no_grad():
        assert loss == pytest.approx(float(token_weighted_loss(module, micro_batches)), rel=1e-5)


@pytest.mark.slow
def test_two_ddp_ranks_with_the_fused_loss_equal_one_process(tiny_model_dir, uneven_file, tmp_path):
    steps, accumulate = 3, 2
    args = {"model": str(tiny_model_dir), "data": str(uneven_file), "out": str(tmp_path / "ddp")}
    args.update(max_steps=steps, batch_size=1, accumulate_grad_batches=accumulate, strategy="ddp_lora")
    ranks = run_ddp_fit(args)
    checkpoint = torch.load(tmp_path / "ddp" / "last.ckpt", weights_only=True)
    assert len(checkpoint["rng_states"]) == 2 and checkpoint["global_step"] == steps

    module, data = make(tiny_model_dir, uneven_file, batch_size=2)  # the same global batches, reference loss
    recorder = Recorder()
    run = trainer(tmp_path, max_steps=steps, accumulate_grad_batches=accumulate, limit_val_batches=0)
    run.callbacks.append(recorder)
    run.fit(module, datamodule=data)

    single = module.trainable_state_dict()
    for rank in ranks:
        assert rank["weights_per_step"][-1].keys() == single.keys()
        for name, value in rank["weights_per_step"][-1].items():
            torch.testing.assert_close(value, single[name], atol=1e-5, rtol=0, msg=name)
        step_losses = rank["losses"][accumulate - 1 :: accumulate]  # logged at each window's end
        torch.testing.assert_close(
            torch.tensor(step_losses), torch.tensor(recorder.losses[accumulate - 1 :: accumulate])
        )
