"""quantkit.memory: the kernel-cache caps a server sets, and that a user's own setting wins."""

from __future__ import annotations

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
