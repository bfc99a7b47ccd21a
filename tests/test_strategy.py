"""Our strategies: registered by name and former name, follow the Trainer's devices, leave the loss
to the module."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lit_instruct.loss.fused import FusedLinearCrossEntropy
from lit_instruct.loss.reference import reference_linear_cross_entropy
from lit_instruct.train import strategy as strategy_module
from lit_instruct.train.strategy import LoRADDPStrategy, LoRAFSDPStrategy, OneDeviceStrategy
from tests.helpers import make, trainer


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_strategies_are_registered_by_name() -> None:
    assert StrategyRegistry["one_device"]["strategy"] is OneDeviceStrategy
    assert StrategyRegistry["ddp_lora"]["strategy"] is LoRADDPStrategy
    trainer = L.Trainer(accelerator="cpu", strategy="one_device", logger=False)
    assert isinstance(trainer.strategy, OneDeviceStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_lora", logger=False)
    assert isinstance(ddp.strategy, LoRADDPStrategy) and ddp.strategy.world_size == 2


@pytest.mark.parametrize(
    ("former", "former_class", "cls"),
    [
        ("fused_ce", "FusedCESingleDeviceStrategy", OneDeviceStrategy),
        ("fused_ce_ddp", "FusedCEDDPStrategy", LoRADDPStrategy),
        ("fused_ce_fsdp", "FusedCEFSDPStrategy", LoRAFSDPStrategy),
    ],
)
def test_the_former_strategy_names_still_run(former: str, former_class: str, cls: type) -> None:
    assert StrategyRegistry[former]["strategy"] is cls
    assert getattr(strategy_module, former_class) is cls  # a config's class_path of an earlier release


def test_the_trainer_hands_its_device_to_one_device() -> None:
    """Lightning's accelerator connector sets ``parallel_devices`` on the strategy instance: if it
    stops doing so, a ``one_device`` run would silently stay on the default device."""
    strategy = OneDeviceStrategy()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    assert strategy._chosen == torch.device("cpu") and strategy.root_device == torch.device("cpu")
    given = OneDeviceStrategy(device="cpu")
    L.Trainer(accelerator="cpu", devices=1, strategy=given, logger=False)
    assert given._chosen is None and given.root_device == torch.device("cpu")


def test_one_device_refuses_several_devices() -> None:
    with pytest.raises(ValueError, match="ddp_lora"):
        L.Trainer(accelerator="cpu", devices=2, strategy="one_device", logger=False)


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
        tiny_model_dir, chat_file, tmp_path / "ref", OneDeviceStrategy(), loss="reference"
    )
    assert loss_fn is reference_linear_cross_entropy
    fused, loss_fn = train_losses(tiny_model_dir, chat_file, tmp_path / "fused", "auto")
    assert loss_fn == FusedLinearCrossEntropy()  # the default
    assert len(fused) == len(reference) == 5
    assert reference[0] != reference[-1]  # the weights moved
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(reference), rtol=1e-4, atol=0)
