"""Keep freed memory in the process on CPU, so that activations are not page-faulted in every step.

glibc's malloc serves large blocks (from 128 KiB, raised on the fly up to 32 MiB) with fresh ``mmap``
calls and hands freed memory back to the kernel, so every activation of a training step is zeroed
and faulted in again page by page: an elementwise op on a fresh 6 MiB tensor ran ~10x slower than
on a reused one on the 2-core test machine (one page fault per 4 KiB). With :func:`retain_freed_memory`
blocks come from the heap and freed ones stay there for the next step; the peak resident memory is
unchanged (it is the peak of what is in use plus the heap's fragmentation), but nothing shrinks after
the peak. The usual remedy, preloading jemalloc or tcmalloc, needs a library this package cannot
install.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
"""Blocks up to 1 GiB come from the heap (``mallopt`` takes an int: 2 GiB is its bound)."""


@functools.cache
def retain_freed_memory() -> bool:
    """Tell glibc (Linux) to serve blocks up to 1 GiB from the heap and never trim it; once per
    process. Returns whether it took effect (``False`` off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
