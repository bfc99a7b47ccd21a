"""Instruction data: records, rendering and masking, batching, and the LightningDataModule."""

from lit_instruct.data.collate import PackCollator, PadCollator
from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError, Message, Record
from lit_instruct.data.render import ChatRenderer, Sample
from lit_instruct.data.sampler import InstructSampler
from lit_instruct.data.sources import DataSource, read_source
from lit_instruct.data.store import SampleStore
from lit_instruct.labels import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "ChatRenderer",
    "DataError",
    "DataSource",
    "InstructDataModule",
    "InstructSampler",
    "Message",
    "PackCollator",
    "PadCollator",
    "Record",
    "Sample",
    "SampleStore",
    "read_source",
]
