"""Giving freed heap memory back to the operating system between layers.

glibc raises its mmap threshold each time a large block is freed, so later blocks of that size
come from the heap, and a freed heap block in the middle of the heap is not returned. Over a
layer loop that allocates and frees one layer's tensors at a time, RSS then creeps up by tens of
MiB per layer. `malloc_trim(0)` returns those pages; on other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
