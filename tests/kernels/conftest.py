"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest

from quantkit.kernels import cpu_ext


@pytest.fixture(scope="module")
def attn(cpu_level):
    """paged_attention_cpu, with the C++ extension built (skips where no toolchain is found)."""
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    from quantkit.kernels.paged_attention_cpu import cpu_attention, paged_attention_cpu

    assert cpu_attention() is not None, cpu_ext.cpu_extension_unavailable("quantkit_attn")
    return paged_attention_cpu


@pytest.fixture(params=["per-row", "widened-block", "amx"])
def avx512_step(request, attn):
    """The attention step's paths, one after the other: every row over a block on its own, and the block widened once
    for all rows (from 1 row on), both with the AMX step off; then the AMX step (a bf16 cache) from 1 row on, skipped
    where this CPU gives no AMX tiles. Where the AVX-512 step is not compiled in, the first two take the portable
    loops."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    amx = request.param == "amx"
    if amx and not mod.has_amx():
        pytest.skip("the AMX attention step needs a CPU with AMX-BF16 (and a Linux that grants the tiles)")
    old_amx = mod.dev.set_amx(amx)
    old_rows = mod.dev.set_amx_attention_from_rows(1) if amx else None
    old = mod.dev.set_widen_from_rows(1 if request.param == "widened-block" else 1 << 40)
    yield request.param
    if old > 0:
        mod.dev.set_widen_from_rows(old)
    mod.dev.set_amx(old_amx)
    if old_rows is not None and old_rows > 0:
        mod.dev.set_amx_attention_from_rows(old_rows)
