"""lit-instruct: instruction fine-tuning of causal LMs with LoRA, as a first-class Lightning citizen."""

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.model import LoRAConfig
from lit_instruct.module import InstructLoRAModule

__all__ = ["InstructDataModule", "InstructLoRAModule", "LoRAConfig"]
__version__ = "0.1.0"
