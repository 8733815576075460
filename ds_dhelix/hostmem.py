"""Host allocator settings for training on CPU.

glibc serves allocations above its mmap threshold (128 KiB at start, raised on the fly) with fresh
``mmap`` pages and returns the heap's free top to the OS past its trim threshold. A training step
allocates and frees the same activation-sized buffers (0.5-8 MiB here) op after op, so many of
them come back as new pages and page-fault on first touch. Op-by-op execution (the SI executor's
detached op boundaries) frees and reallocates more often than one autograd graph does, so it paid
more: on tiny-llama, 8 micro-batches of 4 x 256 tokens, one CPU thread, a step of the executor took
880 ms and plain HF 775 ms; with the settings below 770 and 715 ms (``scripts/gpu_checks.py
--device cpu`` measures the same comparison).

``keep_freed_memory()`` raises the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold to its maximum, so freed buffers stay mapped and are reused. Resident memory then stays
at the step's peak instead of shrinking between steps. Off glibc it does nothing; set
``DHELIX_MALLOC_TUNING=0`` to leave the allocator alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_MAX = 2 ** 31 - 1  # mallopt takes an int

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when glibc accepted them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("DHELIX_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD_MAX))
    return _applied
