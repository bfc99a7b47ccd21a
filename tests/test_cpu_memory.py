"""Freed memory stays in the process on CPU: a second large tensor is not page-faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from lit_instruct.cpu_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
for step in range(3):  # a training step's pattern: blocks of several sizes, each freed after use
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in (6, 16, 30, 64):
        torch.ones(mib * 2**18)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)  # in the third step
"""


def page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults() -> None:
    """By default glibc maps blocks over 32 MiB afresh every time (30 + 64 MiB: 24,064 faults of 4
    KiB in every step); retained, the third step reuses the heap and faults next to none."""
    assert page_faults("default") > 20000
    assert page_faults("retain") < 1000
