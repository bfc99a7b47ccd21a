"""Lines of other libraries that reach the first screen of every run and that the user cannot act on,
silenced narrowly: each by its message and the module that emits it, nothing else of that module's.

:func:`silence_known_noise` runs on ``import lit_instruct``; a test fits twice and checks the output
holds none of them (``tests/test_first_screen.py``).
"""

from __future__ import annotations

import logging
import warnings

LOG_LINES = (
    # Lightning advertises its cloud logger on every fit that does not use it
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    # Lightning's own account of the devices and the precision: lit-instruct's precision line says both
    ("lightning.pytorch.utilities.rank_zero", "Automatic Mixed Precision (AMP)"),
    ("lightning.pytorch.utilities.rank_zero", "GPU available: "),
    ("lightning.pytorch.utilities.rank_zero", "TPU available: "),
    ("lightning.pytorch.utilities.rank_zero", "to estimate number of stepping batches"),
    # the seed is in the config (seed_everything) and in config.yaml
    ("lightning.fabric.utilities.seed", "Seed set to "),
    # peft imports bitsandbytes whenever it is installed, and on an AVX512-BF16 CPU bitsandbytes says it
    # could not fetch a hub kernel for its repacked 4-bit CPU layout, which lit-instruct switches off
    # (lit_instruct.models.four_bit)
    ("bitsandbytes.backends.cpu.ops", "kernels-community"),
)
"""(logger, the start or a part of a record it emits that is dropped)."""

WARNINGS = (
    # Lightning's own pytree helper uses a class torch has deprecated: for Lightning to change
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
    ),
    # peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    # the model summary's size estimate knows fp32 and fp16 only, and says so under bf16
    (r"Precision bf16-mixed is not supported by the model summary", UserWarning, r"lightning\.pytorch"),
)
"""(message, category, emitting module) of each warning that is ignored."""


class _DropLine(logging.Filter):
    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part

    def filter(self, record: logging.LogRecord) -> bool:
        return self.part not in record.getMessage()


def silence_known_noise() -> None:
    """Install the filters (idempotent)."""
    for name, part in LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLine) and f.part == part for f in logger.filters):
            logger.addFilter(_DropLine(part))
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
