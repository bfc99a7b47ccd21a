"""The fused_ce strategies: registered by name, follow the Trainer's devices, leave the loss to the module."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lit_instruct.loss.fused import FusedLinearCrossEntropy
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.train.strategy import FusedCEDDPStrategy, FusedCESingleDeviceStrategy
from tests.helpers import make, trainer


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_strategies_are_registered_by_name() -> None:
    assert StrategyRegistry["fused_ce"]["strategy"] is FusedCESingleDeviceStrategy
    assert StrategyRegistry["fused_ce_ddp"]["strategy"] is FusedCEDDPStrategy
    trainer = L.Trainer(accelerator="cpu", strategy="fused_ce", logger=False)
    assert isinstance(trainer.strategy, FusedCESingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="fused_ce_ddp", logger=False)
    assert isinstance(ddp.strategy, FusedCEDDPStrategy) and ddp.strategy.world_size == 2


def test_the_trainer_hands_its_device_to_fused_ce() -> None:
    """Lightning's accelerator connector sets ``parallel_devices`` on the strategy instance: if it
    stops doing so, a ``fused_ce`` run would silently stay on the default device."""
    strategy = FusedCESingleDeviceStrategy()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert strategy._chosen == torch.device("cpu") and strategy.root_device == torch.device("cpu")
    given = FusedCESingleDeviceStrategy(device="cpu")
    L.Trainer(accelerator="cpu", devices=1, strategy=given, logger=False)
    assert given._chosen is None and given.root_device == torch.device("cpu")


def test_fused_ce_refuses_several_devices() -> None:
    with pytest.raises(ValueError, match="fused_ce_ddp"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fused_ce", logger=False)


def train_losses(tiny_model_dir, chat_file, tmp_path, strategy, **options) -> tuple[list[float], object]:
    module, data = make(tiny_model_dir, chat_file, **options)
    data.batch_size = 2
    recorder = LossRecorder()
    trainer(tmp_path, strategy=strategy, max_steps=5, limit_val_batches=0, callbacks=[recorder]).fit(
        module, datamodule=data
    )
    return recorder.losses, module.loss_fn


def test_the_module_keeps_its_loss_on_any_strategy(tiny_model_dir, chat_file, tmp_path) -> None:
    reference, loss_fn = train_losses(
        tiny_model_dir, chat_file, tmp_path / "ref", FusedCESingleDeviceStrategy(), loss="reference"
    )
    assert loss_fn is reference_linear_cross_entropy
    fused, loss_fn = train_losses(tiny_model_dir, chat_file, tmp_path / "fused", "auto")
    assert loss_fn == FusedLinearCrossEntropy()  # the default
    assert len(fused) == len(reference) == 5
    assert reference[0] != reference[-1]  # the weights moved
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(reference), rtol=1e-4, atol=0)
