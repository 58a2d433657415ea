"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest

from quantkit.kernels import cpu_ext


@pytest.fixture(scope="module")
def attn():
    """paged_attention_cpu, with the C++ extension built (skips where no toolchain is found)."""
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    from quantkit.kernels.paged_attention_cpu import cpu_attention, paged_attention_cpu

    assert cpu_attention() is not None, cpu_ext.cpu_extension_unavailable("quantkit_attn")
    return paged_attention_cpu


@pytest.fixture(params=["per-row", "widened-block"])
def avx512_step(request, attn):
    """The AVX-512 attention step's two paths, one after the other: every row over a block on its own,
    and the block widened once for all rows (from 1 row on). Where that step is not compiled in, both
    runs take the portable loops."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    old = mod.set_widen_from_rows(1 if request.param == "widened-block" else 1 << 40)
    yield request.param
    if old > 0:
        mod.set_widen_from_rows(old)
