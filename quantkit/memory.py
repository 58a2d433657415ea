"""Giving freed heap memory back to the operating system, so a layer loop's peak does not creep.

glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, so later blocks
of that size come from the heap, where freed space in the middle is not returned and fragments.
Over a loop that allocates and frees one layer's tensors at a time, peak RSS then creeps up by
~13 MiB per TinyLlama-1.1B-shaped layer (docs/BENCHMARKS.md). Two remedies, both no-ops on other
C libraries: `release_freed_memory` (malloc_trim, between layers) and `bound_heap` (a fixed 1 MiB
mmap threshold: every block that size or larger goes back to the system when freed; the creep
vanishes, at ~10-15% more time on a CPU run, from page faults on fresh blocks).

A server has one more source: oneDNN keeps the linear kernels it builds for each input shape, and a
server's steps see a new token count M all the time. Two caches hold them: oneDNN's primitive cache
and ideep's per-thread cache of primitive descriptors, 1024 entries each by default, ~250 KiB an
entry for the prepacked linears (measured with heaptrack on stories260K, 2026-12-01): RSS then grows
run after run until they fill. `bound_kernel_caches` caps both (a process-wide setting, read when
oneDNN first builds a kernel: meant for the CLI edge, before the model runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@cache
def _libc_function(name: str):
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name, None)
    except OSError:
        return None


def release_freed_memory() -> None:
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


# `quantize --low-memory` by default from this many bytes of weights in fp32 (the layer loop's dtype) up:
# below it the creep cannot add up to much (it is ~15% of one layer per layer, docs/BENCHMARKS.md) and the
# bounded heap's page faults cost 40-65% of the time on a small model's CPU run (measured on the GQA test model)
LOW_MEMORY_AUTO_BYTES = 1 << 30


def low_memory_by_default(fp32_weight_bytes: int) -> bool:
    """Whether `quantize` bounds the heap when the user did not say: for models of 1 GiB (fp32) or more."""
    return fp32_weight_bytes >= LOW_MEMORY_AUTO_BYTES


def bound_heap(mmap_threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold for this process (a process-wide setting, like torch's thread
    count: meant for the CLI edge). Returns whether it took effect."""
    mallopt = _libc_function("mallopt")
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, mmap_threshold))


KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's (torch's)


def bound_kernel_caches(capacity: int) -> dict[str, str]:
    """Cap oneDNN's and ideep's per-shape kernel caches at `capacity` entries each, unless the user set
    them; returns the settings in force. Takes effect only before oneDNN's first kernel in this process."""
    return {name: os.environ.setdefault(name, str(capacity)) for name in KERNEL_CACHE_ENV}
