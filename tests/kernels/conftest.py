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
