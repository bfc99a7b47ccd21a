"""SkipNonFiniteSteps with a real Trainer: skipped steps leave weights, optimizer and LR untouched."""

from __future__ import annotations

import json

import pytest
import torch

from lit_instruct.callbacks import NonFiniteTrainingError, SkipNonFiniteSteps
from tests.ddp_fit import run_ddp_fit
from tests.helpers import FaultyModule, Recorder, make, trainer


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_states_equal(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("fault", ["nan_loss_at", "inf_grad_at"])
def test_skipped_step_leaves_weights_optimizer_and_lr_untouched(tiny_model_dir, chat_file, tmp_path, fault):
    faults = {fault: (2,)}
    module, data = make(tiny_model_dir, chat_file, FaultyModule, batch_size=1, warmup_steps=2, **faults)
    skip, recorder = SkipNonFiniteSteps(max_consecutive=3), Recorder()
    run = trainer(tmp_path, max_steps=5, limit_val_batches=0, callbacks=[skip, recorder])
    with pytest.warns(UserWarning, match="step 2: non-finite loss or gradient, optimizer step skipped"):
        run.fit(module, datamodule=data)

    (w1, opt1, lr1), (w2, opt2, lr2), (w3, _, _) = recorder.states[1:4]
    assert_states_equal(w2, w1)  # the skipped step changed no weight ...
    assert_states_equal(opt2, opt1)  # ... no optimizer moment or step count ...
    assert lr2 == lr1  # ... and did not advance the schedule
    assert not torch.equal(next(iter(w3.values())), next(iter(w2.values())))  # the next step trains
    assert all(torch.isfinite(v).all() for v in w3.values())

    scheduled = [recorder.states[i][2] for i in range(5)]
    factor = module.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    expected = [1e-2 * factor(k) for k in (1, 2, 2, 3, 4)]  # the schedule resumes where it stood
    torch.testing.assert_close(torch.tensor(scheduled), torch.tensor(expected))
    assert (skip.skipped, skip.consecutive) == (1, 0)
    assert run.callback_metrics["train/skipped_steps"] == 1.0
    assert run.callback_metrics["train/consecutive_skipped_steps"] == 0.0


def test_accumulation_window_with_one_nan_micro_batch_is_discarded(tiny_model_dir, chat_file, tmp_path):
    def first_window_weights(**faults) -> dict[str, torch.Tensor]:
        module, data = make(tiny_model_dir, chat_file, FaultyModule, batch_size=1, **faults)
        before = {k: v.clone() for k, v in module.trainable_state_dict().items()}
        skip = SkipNonFiniteSteps()
        trainer(tmp_path, max_steps=1, accumulate_grad_batches=4, limit_val_batches=0, callbacks=[skip]).fit(
            module, datamodule=data
        )
        return before, module.trainable_state_dict(), skip.skipped

    before, after, skipped = first_window_weights(nan_loss_at=(1,))  # micro-batch 2 of 4
    assert skipped == 1
    assert_states_equal(after, before)
    before, after, skipped = first_window_weights()
    assert skipped == 0
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the control window does train


def test_consecutive_skips_stop_with_a_checkpoint_and_counters_survive_resume(
    tiny_model_dir, chat_file, tmp_path
):
    module, data = make(tiny_model_dir, chat_file, FaultyModule, batch_size=1, nan_loss_at=(1, 2, 3, 4, 5))
    initial_after_step0 = Recorder()
    run = trainer(tmp_path, max_steps=10, limit_val_batches=0)
    run.callbacks += [SkipNonFiniteSteps(max_consecutive=2), initial_after_step0]
    with pytest.warns(UserWarning), pytest.raises(NonFiniteTrainingError, match="2 optimizer steps in a row"):
        run.fit(module, datamodule=data)

    path = tmp_path / "checkpoints" / "nonfinite-stop-step=3.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == 3
    good = initial_after_step0.states[0][0]  # weights after step 0, the last finite step
    assert_states_equal({k: checkpoint["state_dict"][k] for k in good}, good)
    assert checkpoint["callbacks"]["SkipNonFiniteSteps"] == {"skipped": 2, "consecutive": 2}

    resumed = SkipNonFiniteSteps(max_consecutive=5)
    module, data = make(tiny_model_dir, chat_file)
    trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[resumed]).fit(
        module, datamodule=data, ckpt_path=path
    )
    assert (resumed.skipped, resumed.consecutive) == (2, 0)  # restored, then reset by a finite step


@pytest.mark.slow
def test_ddp_nan_on_one_rank_skips_on_both(tiny_model_dir, tmp_path):
    out, data = tmp_path / "ddp", tmp_path / "sums.jsonl"
    chats = [{"prompt": f"What is {i} + {i}?", "completion": f"{i} + {i} = {2 * i}."} for i in range(12)]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))  # 6 batches per rank and epoch
    args = {"model": str(tiny_model_dir), "data": str(data), "out": str(out), "max_steps": 5}
    args.update(fault_rank=1, nan_loss_at=[1], inf_grad_at=[3])  # Inf put in after DDP's all-reduce
    args.update(preview=["Hi"])  # validations with GenerationPreview: rank 0 generates, no rank hangs
    ranks = run_ddp_fit(args)
    assert (out / "generations.txt").read_text().count("[step ") == 2  # at steps 2 and 4
    for rank in ranks:
        assert rank["skipped"] == 2 and rank["consecutive"] == 0
        steps = rank["weights_per_step"]
        for skipped in (1, 3):  # on both ranks
            assert_states_equal(steps[skipped], steps[skipped - 1])
            assert not torch.equal(
                next(iter(steps[skipped + 1].values())), next(iter(steps[skipped].values()))
            )
    assert_states_equal(ranks[0]["weights_per_step"][-1], ranks[1]["weights_per_step"][-1])


def test_a_plain_trainer_skips_non_finite_steps_without_being_told(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    """The module installs the guard itself (issue 50): a ``Trainer`` given no callback skips a NaN
    step all the same, and the weights stay finite."""
    module, data = make(tiny_model_dir, chat_file, FaultyModule, batch_size=1, nan_loss_at=(2,))
    recorder = Recorder()
    run = trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[recorder])
    with pytest.warns(UserWarning, match="step 2: non-finite loss or gradient, optimizer step skipped"):
        run.fit(module, datamodule=data)
    (guard,) = [callback for callback in run.callbacks if isinstance(callback, SkipNonFiniteSteps)]
    assert (guard.skipped, guard.max_consecutive) == (1, 10)
    assert_states_equal(recorder.states[2][0], recorder.states[1][0])
    assert all(torch.isfinite(value).all() for value in recorder.states[-1][0].values())
