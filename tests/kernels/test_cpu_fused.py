"""The fused C++ CPU ops (extension quantkit_attn) against their torch references."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import cpu_ext, fused_ops_reference as ref


@pytest.fixture(scope="module")
def fused():
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    from quantkit.kernels import cpu_fused

    assert cpu_fused.available(torch.zeros(1)), cpu_ext.cpu_extension_unavailable("quantkit_attn")
    return cpu_fused


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows,hidden", [(1, 1024), (37, 64), (5, 20)])
def test_rms_norm(fused, rows, hidden):
    x, w = randn(rows, hidden), randn(hidden, seed=1)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))


def test_add_rms_norm_in_place(fused):
    x, r, w = randn(9, 96), randn(9, 96, seed=1), randn(96, seed=2)
    want_h, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    h, res = fused.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(res, want_r)
    assert h.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()  # in place: no temporaries


def test_silu_and_mul(fused):
    g, u = randn(13, 2816) * 4, randn(13, 2816, seed=1)
    torch.testing.assert_close(fused.silu_and_mul(g, u), ref.silu_and_mul(g, u))


@pytest.mark.parametrize("hq,hk,d", [(16, 8, 64), (4, 4, 8)])
def test_rotary_in_place(fused, hq, hk, d):
    t = 11
    q, k = randn(t, hq, d), randn(t, hk, d, seed=1)
    ang = randn(t, d // 2, seed=2)
    emb = torch.cat((ang, ang), dim=-1)
    want_q, want_k = ref.rotary(q, k, emb.cos(), emb.sin())
    got_q, got_k = fused.rotary(q, k, emb.cos(), emb.sin())
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_partial_rotary_takes_the_reference(fused):
    q, k = randn(3, 2, 16), randn(3, 1, 16, seed=1)
    cos, sin = randn(3, 8, seed=2).cos(), randn(3, 8, seed=3).sin()
    want = ref.rotary(q, k, cos, sin)
    got = fused.rotary(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_rejects_other_dtypes(fused):
    with pytest.raises(RuntimeError, match="float32"):
        fused.silu_and_mul(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
