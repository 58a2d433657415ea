"""quantkit.memory: the kernel-cache caps a server sets, and that a user's own setting wins."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from quantkit.memory import KERNEL_CACHE_ENV, bound_kernel_caches


def test_bound_kernel_caches_sets_both_unless_the_user_did(monkeypatch):
    for name in KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert bound_kernel_caches(128) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "7"}



def test_quantize_bounds_the_heap_by_default_from_one_gib_of_fp32_weights():
    from quantkit.memory import LOW_MEMORY_AUTO_BYTES, low_memory_by_default

    assert LOW_MEMORY_AUTO_BYTES == 1 << 30
    assert low_memory_by_default(1 << 30)
    assert not low_memory_by_default((1 << 30) - 1)


# bf16 linears of an MoE expert's shapes (2048 -> 768 -> 2048) at `n` distinct token counts, as an MoE layer's experts
# each see their own routed count; prints RSS growth in MiB after the passes, freed memory given back
MANY_SHAPES = """
import ctypes, gc, re, torch
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
torch.set_num_threads(1)
w1, w2 = torch.randn(768, 2048), torch.randn(2048, 768)
def step(m):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        torch.nn.functional.linear(torch.nn.functional.linear(torch.randn(m, 2048), w1), w2)
step(64); gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
before = rss()
for m in range(65, 265):
    step(m)
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
print(rss() - before)
"""


def growth_mib(env: dict[str, str]) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", MANY_SHAPES], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return float(re.findall(r"[-\d.]+", out)[-1])


def test_bounded_kernel_caches_keep_rss_flat_over_many_shapes(monkeypatch):
    """What `quantize --low-memory` sets (quantkit.commands.quantize.KERNEL_CACHE_ENTRIES): 200 new shapes leave
    oneDNN's and ideep's caches at a few MiB, where the defaults keep ~0.6 MiB per shape."""
    if not os.path.isfile("/proc/self/status"):
        pytest.skip("needs Linux /proc/self/status")
    from quantkit.commands.quantize import KERNEL_CACHE_ENTRIES

    unbounded = growth_mib({})
    if unbounded < 60:
        pytest.skip(f"this torch's oneDNN keeps little per shape ({unbounded:.0f} MiB for 200 shapes): nothing to bound")
    for name in KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    bounded = growth_mib(bound_kernel_caches(KERNEL_CACHE_ENTRIES))
    assert bounded < 30, f"{bounded:.0f} MiB kept by 200 shapes with the caches at {KERNEL_CACHE_ENTRIES} (unbounded {unbounded:.0f})"
