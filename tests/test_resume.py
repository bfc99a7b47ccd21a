"""Exact resume mid-epoch, and checkpoints that hold only the trainable state."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_instruct.callbacks import SkipNonFiniteSteps
from lit_instruct.models.lora import LoRAConfig
from tests.helpers import Recorder, StopAfter, make, trainer

LORA = LoRAConfig(r=64, alpha=16, dropout=0.2, target_modules="all-linear")  # dropout: RNG matters


def fit(tiny_model_dir, chat_file, root, *callbacks, ckpt_path=None) -> tuple[Recorder, L.Trainer]:
    module, data = make(tiny_model_dir, chat_file, batch_size=1, lora=LORA, warmup_steps=2)
    recorder = Recorder()
    run = trainer(root, max_steps=9, limit_val_batches=0, deterministic=True)
    run.callbacks += [SkipNonFiniteSteps(), recorder, *callbacks]
    run.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return recorder, run


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tiny_model_dir, chat_file, tmp_path) -> None:
    uninterrupted, _ = fit(tiny_model_dir, chat_file, tmp_path / "a")  # 6 batches an epoch: 1.5 epochs

    every_4 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first, _ = fit(tiny_model_dir, chat_file, tmp_path / "b", every_4, StopAfter(4))
    assert len(first.losses) == 4
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["datamodule_hyper_parameters"] and len(checkpoint["rng_states"]) == 1

    resumed, run = fit(tiny_model_dir, chat_file, tmp_path / "c", ckpt_path=path)
    assert run.global_step == 9 and len(resumed.losses) == 5
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses[4:]), atol=1e-6, rtol=0
    )
    final, expected = resumed.states[-1][0], uninterrupted.states[-1][0]
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=0)


def test_checkpoint_holds_little_more_than_the_trainable_state(tiny_model_dir, chat_file, tmp_path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    _, run = fit(tiny_model_dir, chat_file, tmp_path, checkpoints, StopAfter(2))
    module = run.lightning_module
    weights = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    optimizer = sum(
        t.numel() * t.element_size() for state in run.optimizers[0].state.values() for t in state.values()
    )
    size = (tmp_path / "ckpt" / "epoch=0-step=2.ckpt").stat().st_size
    assert weights > 500_000  # large enough for the ratio to mean something
    assert size <= 1.1 * (weights + optimizer), (size, weights, optimizer)
    base = sum(p.numel() * p.element_size() for p in module.parameters())
    assert size < 0.2 * base
