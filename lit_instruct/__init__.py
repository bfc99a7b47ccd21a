"""lit-instruct: instruction fine-tuning of causal LMs with LoRA, as a first-class Lightning citizen.

The names below are imported on first use, so that ``import lit_instruct.loss`` (torch only) does
not pull in ``transformers`` and Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lit_instruct.noise import silence_known_noise

__version__ = "0.1.0"

silence_known_noise()

_EXPORTS = {
    "DataSource": "lit_instruct.data.sources",
    "LoRADDPStrategy": "lit_instruct.train.strategy",
    "LoRAFSDPStrategy": "lit_instruct.train.strategy",
    "OneDeviceStrategy": "lit_instruct.train.strategy",
    "FusedLinearCrossEntropy": "lit_instruct.loss.fused",
    "InstructDataModule": "lit_instruct.data.datamodule",
    "InstructLoRAModule": "lit_instruct.train.module",
    "InstructTrainer": "lit_instruct.train.trainer",
    "LoRAConfig": "lit_instruct.models.lora",
    "PreferenceConfig": "lit_instruct.loss.preference",
    "Objective": "lit_instruct.objectives.base",
    "ObjectiveSums": "lit_instruct.objectives.base",
    "SFT": "lit_instruct.objectives.sft",
    "DPO": "lit_instruct.objectives.pairs",
    "IPO": "lit_instruct.objectives.pairs",
    "SimPO": "lit_instruct.objectives.pairs",
    "ORPO": "lit_instruct.objectives.pairs",
    "KTO": "lit_instruct.objectives.kto",
    "fused_linear_cross_entropy": "lit_instruct.loss.fused",
}

__all__ = [
    "DPO",
    "IPO",
    "KTO",
    "ORPO",
    "SFT",
    "DataSource",
    "FusedLinearCrossEntropy",
    "InstructDataModule",
    "InstructLoRAModule",
    "InstructTrainer",
    "LoRAConfig",
    "LoRADDPStrategy",
    "LoRAFSDPStrategy",
    "Objective",
    "ObjectiveSums",
    "OneDeviceStrategy",
    "PreferenceConfig",
    "SimPO",
    "__version__",
    "fused_linear_cross_entropy",
]

if TYPE_CHECKING:
    from lit_instruct.data.datamodule import InstructDataModule
    from lit_instruct.data.sources import DataSource
    from lit_instruct.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
    from lit_instruct.loss.preference import PreferenceConfig
    from lit_instruct.models.lora import LoRAConfig
    from lit_instruct.objectives.base import Objective, ObjectiveSums
    from lit_instruct.objectives.kto import KTO
    from lit_instruct.objectives.pairs import DPO, IPO, ORPO, SimPO
    from lit_instruct.objectives.sft import SFT
    from lit_instruct.train.module import InstructLoRAModule
    from lit_instruct.train.strategy import (
        LoRADDPStrategy,
        LoRAFSDPStrategy,
        OneDeviceStrategy,
    )
    from lit_instruct.train.trainer import InstructTrainer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_instruct' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
