"""lit-instruct: instruction fine-tuning of causal LMs with LoRA, as a first-class Lightning citizen."""

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.loss.fused import FusedLinearCrossEntropy, fused_linear_cross_entropy
from lit_instruct.model import LoRAConfig
from lit_instruct.module import InstructLoRAModule
from lit_instruct.strategy import FusedCEDDPStrategy, FusedCESingleDeviceStrategy

__all__ = [
    "FusedCEDDPStrategy",
    "FusedCESingleDeviceStrategy",
    "FusedLinearCrossEntropy",
    "InstructDataModule",
    "InstructLoRAModule",
    "LoRAConfig",
    "fused_linear_cross_entropy",
]
__version__ = "0.1.0"
