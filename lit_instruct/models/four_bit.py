"""4-bit (QLoRA) bases from bitsandbytes, kept in the layout that trains and shards.

bitsandbytes 0.49 added a CPU inference path: on a CPU with AVX512-BF16, the first forward of a
``Linear4bit`` in eval mode without gradients repacks its weight in place (``uint8`` ``[N, K/2]``,
absmax dequantized to bfloat16). That layout has no backward (the gradient to the layer's input is
silently dropped: every LoRA adapter below it learns from a wrong gradient), is no longer stored in
``bnb_4bit_quant_storage`` (FSDP cannot shard it) and is requantized, lossily, when saved. Our build
checks run exactly such forwards, so the repacking is switched off for every 4-bit layer we load,
and the layout is checked after the build: a bitsandbytes that changes it again is refused, not
trained on.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch
from packaging.version import Version
from torch import nn

from lit_instruct.errors import ConfigError

OLDEST_BITSANDBYTES = "0.47"
"""Older releases dequantize 4-bit weights on the CPU only from uint8 storage (and transformers 5
needs 0.46.1): a base packed in the compute dtype, which FSDP shards, cannot run there."""
TESTED_BITSANDBYTES = f">={OLDEST_BITSANDBYTES},<=0.50.2"
"""The bitsandbytes releases the QLoRA tests passed with (the lock file pins the newest)."""


def bitsandbytes_version() -> str:
    try:
        return version("bitsandbytes")
    except PackageNotFoundError:
        return "(not installed)"


def require_bitsandbytes() -> None:
    """Raise, naming the releases that work, unless a bitsandbytes we can train with is installed."""
    found = bitsandbytes_version()
    if found == "(not installed)" or Version(found) < Version(OLDEST_BITSANDBYTES):
        raise ConfigError(
            "model.quantization.method",
            f"4-bit (QLoRA) bases need bitsandbytes{TESTED_BITSANDBYTES}, found {found} "
            f"(pip install 'lit-instruct[qlora]' or 'bitsandbytes{TESTED_BITSANDBYTES}')",
        )


def keep_training_layout(model: nn.Module) -> None:
    """Switch off bitsandbytes' in-place CPU repacking of ``Linear4bit`` weights (0.49+; older
    releases have no such attribute and never repack)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False  # type: ignore[assignment]  # a plain bool there


def check_training_layout(model: nn.Module, storage: torch.dtype) -> None:
    """Raise unless the model has 4-bit weights and every one is packed in ``storage`` in
    bitsandbytes' trainable layout (``[n, 1]``, quantization state not repacked for the CPU)."""
    packed = [(n, p) for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    if not packed:
        raise RuntimeError(
            f"bitsandbytes {bitsandbytes_version()}: 4-bit quantization was asked for but no layer of "
            "the model was quantized; install bitsandbytes" + TESTED_BITSANDBYTES
        )
    wrong = [
        (n, p)
        for n, p in packed
        if p.dtype != storage
        or p.dim() != 2
        or p.shape[1] != 1
        or getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False)
    ]
    if wrong:
        name, p = wrong[0]
        raise RuntimeError(
            f"bitsandbytes {bitsandbytes_version()}: the 4-bit weight {name} (and {len(wrong) - 1} more) is "
            f"stored as {p.dtype} {tuple(p.shape)}, not packed in {storage} as [n, 1]: this release lays "
            "4-bit weights out in a way lit-instruct cannot train or shard; install "
            "bitsandbytes" + TESTED_BITSANDBYTES
        )
