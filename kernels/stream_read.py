"""The machine's memory read bandwidth: a streaming read of a buffer far larger than the caches
(kernels/csrc/stream_read_cpu.cpp), and its pure-torch reference.

A decode step that reads every weight once can go no faster than bandwidth / bytes read per token, so the benchmarks
report decode speed as a fraction of that bound; the bound is only as good as the loop that measures it. A torch
reduction (`buf.sum()`) understates it: on this machine llama.cpp's F32 decode read its weights faster than a 2-thread
fp32 sum does. The kernel reads as STREAM's and likwid-bench's read kernels do: each thread its own contiguous share,
full-width loads into independent accumulators, every line prefetched a distance ahead. No one distance reads fastest
on every host (on one EPYC the fp32 sum outread the kernel at its former single 1 KiB distance), so the bound is the
best over PREFETCH_DISTANCES, timed in alternating rounds. What it returns, the sum of the buffer's 32-bit words
modulo 2^32, only keeps the loads from being optimized away; the reference computes the same number exactly.
"""

from __future__ import annotations

import time

import torch

from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension

EXTENSION = "quantkit_stream"
SOURCES = ("stream_read_cpu.cpp",)
GiB = 1024**3
# prefetch distances tried, in bytes: none (the hardware's prefetchers alone), 1 KiB, a 4 KiB page (where the
# hardware's stream prefetcher stops), two pages
PREFETCH_DISTANCES = (0, 1024, 4096, 8192)


def extension():
    """The compiled kernel module, or None (then `unavailable()` says why)."""
    return load_cpu_extension(EXTENSION, SOURCES)


def unavailable() -> str | None:
    return None if extension() is not None else cpu_extension_unavailable(EXTENSION)


def read_sum_reference(buf: torch.Tensor) -> int:
    """buf: uint8 [bytes], bytes a multiple of 4 -> the sum of its little-endian 32-bit words mod 2^32."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % 4:
        raise ValueError("read_sum: a 1-d uint8 buffer whose length is a multiple of 4 bytes")
    words = buf.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # unsigned
    return int(words.sum()) % 2**32


def read_sum(buf: torch.Tensor, threads: int, ahead: int = 1024) -> int:
    """As read_sum_reference, read by the kernel with `threads` OpenMP threads, each line prefetched `ahead` bytes
    early (the pure-torch path without the kernel)."""
    ext = extension()
    return read_sum_reference(buf) if ext is None else ext.read_sum(buf, threads, ahead)


def stream_read_rates(threads: int, gib: float = 2.0, repeats: int = 5,
                      distances: tuple[int, ...] = PREFETCH_DISTANCES, buf: torch.Tensor | None = None
                      ) -> dict[int, float]:
    """{prefetch distance: bytes read per second} by the kernel over `gib` GiB (or `buf`, uint8, every page touched:
    one in huge pages, say) with `threads` threads, best of `repeats` rounds, each round every distance once (so that
    a drift of the host's bandwidth reaches them alike). Raises RuntimeError where the kernel is not built (the
    reference is no measure of speed)."""
    ext = extension()
    if ext is None:
        raise RuntimeError(f"the streaming-read kernel is not built: {unavailable()}")
    if buf is None:
        buf = torch.full((int(gib * GiB) // 64 * 64,), 1, dtype=torch.uint8)  # every page touched before timing
    ext.read_sum(buf, threads, 0)
    best = dict.fromkeys(distances, float("inf"))
    for _ in range(repeats):
        for ahead in distances:
            start = time.perf_counter()
            ext.read_sum(buf, threads, ahead)
            best[ahead] = min(best[ahead], time.perf_counter() - start)
    return {ahead: buf.numel() / s for ahead, s in best.items()}


def stream_read_bandwidth(threads: int, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes read per second by the kernel at its best prefetch distance (stream_read_rates)."""
    return max(stream_read_rates(threads, gib, repeats).values())
