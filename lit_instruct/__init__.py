"""lit-instruct: instruction fine-tuning of causal LMs with LoRA, as a first-class Lightning citizen.

The names below are imported on first use, so that ``import lit_instruct.loss`` (torch only) does
not pull in ``transformers`` and Lightning.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# peft imports bitsandbytes whenever it is installed, and on an AVX512-BF16 CPU bitsandbytes then says
# it could not fetch a hub kernel for its repacked 4-bit CPU inference layout: a layout lit-instruct
# switches off (lit_instruct.models.four_bit), so the notice is noise on every run, QLoRA or not.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "kernels-community" not in record.getMessage()
)

_EXPORTS = {
    "DataSource": "lit_instruct.data.sources",
    "FusedCEDDPStrategy": "lit_instruct.train.strategy",
    "FusedCEFSDPStrategy": "lit_instruct.train.strategy",
    "FusedCESingleDeviceStrategy": "lit_instruct.train.strategy",
    "FusedLinearCrossEntropy": "lit_instruct.loss.fused",
    "InstructDataModule": "lit_instruct.data.datamodule",
    "InstructLoRAModule": "lit_instruct.train.module",
    "InstructTrainer": "lit_instruct.train.trainer",
    "LoRAConfig": "lit_instruct.models.lora",
    "fused_linear_cross_entropy": "lit_instruct.loss.fused",
}

__all__ = [
    "DataSource",
    "FusedCEDDPStrategy",
    "FusedCEFSDPStrategy",
    "FusedCESingleDeviceStrategy",
    "FusedLinearCrossEntropy",
    "InstructDataModule",
    "InstructLoRAModule",
    "InstructTrainer",
    "LoRAConfig",
    "__version__",
    "fused_linear_cross_entropy",
]

if TYPE_CHECKING:
    from lit_instruct.data.datamodule import InstructDataModule
    from lit_instruct.data.sources import DataSource
    from lit_instruct.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
    from lit_instruct.models.lora import LoRAConfig
    from lit_instruct.train.module import InstructLoRAModule
    from lit_instruct.train.strategy import (
        FusedCEDDPStrategy,
        FusedCEFSDPStrategy,
        FusedCESingleDeviceStrategy,
    )
    from lit_instruct.train.trainer import InstructTrainer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_instruct' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
