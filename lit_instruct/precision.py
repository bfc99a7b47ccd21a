"""``precision: auto`` and ``dtype: auto``: bf16 where the device computes it natively, fp32 elsewhere.

Native means the matrix units do bf16 themselves: CUDA devices of compute capability 8.0 and up
(Ampere on), and CPUs whose flags (``/proc/cpuinfo``) include ``avx512_bf16`` or ``amx_bf16``
(Cooper Lake, Sapphire Rapids on; Zen 4 on) while PyTorch runs its AVX-512 kernels there
(``torch.backends.cpu.get_cpu_capability()``). Elsewhere bf16 is emulated: several times slower
than fp32 on an AVX2 CPU, so ``auto`` keeps fp32. Nothing is assumed of a machine it has not read.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

AUTO = "auto"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_CPU_CAPABILITIES = ("AVX512", "AMX")  # what torch.backends.cpu.get_cpu_capability() reports
BF16_CUDA_CAPABILITY = (8, 0)
CPUINFO = Path("/proc/cpuinfo")

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` chose, and why (one line for the fit's first screen)."""

    precision: str
    """The Trainer's precision: ``bf16-mixed`` or ``32-true``."""
    reason: str

    @property
    def dtype(self) -> str:
        """The frozen base weights' dtype that goes with it: ``bfloat16`` or ``float32``."""
        return base_dtype(AUTO, self.precision)

    def line(self) -> str:
        return f"precision: {self.precision}, base weights {self.dtype} (auto: {self.reason})"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (or the text given); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_bf16(cpuinfo: str | None = None, capability: str | None = None) -> tuple[bool, str]:
    """Whether this CPU does bf16 natively, and the evidence in words."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    native = sorted(set(BF16_CPU_FLAGS) & cpu_flags(cpuinfo))
    machine = platform.machine() or "this CPU"
    if not native:
        return False, f"{machine} CPU without avx512_bf16/amx_bf16: bf16 would be emulated, slower than fp32"
    if capability not in BF16_CPU_CAPABILITIES:
        return False, f"the CPU has {'/'.join(native)} but PyTorch runs its {capability} kernels here"
    return True, f"the CPU does bf16 natively ({'/'.join(native)}, {capability} kernels)"


def cuda_bf16(capability: tuple[int, int] | None = None) -> tuple[bool, str]:
    """Whether the current CUDA device does bf16 natively (compute capability >= 8.0)."""
    if capability is None:
        capability = torch.cuda.get_device_capability()
    shown = f"compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) >= BF16_CUDA_CAPABILITY:
        return True, f"the GPU does bf16 natively ({shown})"
    return False, f"the GPU has {shown}, below 8.0: no native bf16"


def training_device(accelerator: object = AUTO) -> Device:
    """The device a Trainer with ``accelerator`` trains on: CUDA when asked for or available (auto)."""
    name = str(accelerator).lower()
    if name in ("cuda", "gpu") or (name == AUTO and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def auto_precision(accelerator: object = AUTO) -> PrecisionChoice:
    """``precision: auto`` for ``accelerator``: ``bf16-mixed`` where bf16 is native, else ``32-true``."""
    device = training_device(accelerator)
    if device == "cuda" and not torch.cuda.is_available():
        return PrecisionChoice("32-true", "no CUDA device is visible")
    native, reason = cuda_bf16() if device == "cuda" else cpu_bf16()
    return PrecisionChoice("bf16-mixed" if native else "32-true", reason)


def is_bf16(precision: object) -> bool:
    """Whether a Trainer precision computes in bf16 (``bf16-mixed``, ``bf16-true``, ``bf16``)."""
    return str(precision).startswith("bf16")


def base_dtype(dtype: str, precision: object) -> str:
    """``model.dtype`` resolved: ``auto`` is ``bfloat16`` under a bf16 precision, else ``float32``."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if is_bf16(precision) else "float32"
