"""The fused C++ CPU ops (extension quantkit_attn) against their torch references."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import cpu_ext, fused_ops_reference as ref

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)


@pytest.fixture(scope="module")
def fused(cpu_level):
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    from quantkit.kernels import cpu_fused

    assert cpu_fused.available(torch.zeros(1)), cpu_ext.cpu_extension_unavailable("quantkit_attn")
    return cpu_fused


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1024), (37, 64), (5, 20)])
def test_rms_norm(fused, rows, hidden, dtype):
    x, w = randn(rows, hidden).to(dtype), randn(hidden, seed=1).to(dtype)
    got = fused.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(fused, dtype):
    x, r, w = randn(9, 96).to(dtype), randn(9, 96, seed=1).to(dtype), randn(96, seed=2).to(dtype)
    want_h, want_r = ref.add_rms_norm(x, r, w, 1e-6)
    h, res = fused.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(res, want_r, rtol=0, atol=0)  # one rounded add, as torch's
    assert h.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()  # in place: no temporaries


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(fused, dtype):
    g, u = (randn(13, 2816) * 4).to(dtype), randn(13, 2816, seed=1).to(dtype)
    torch.testing.assert_close(fused.silu_and_mul(g, u), ref.silu_and_mul(g, u))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_past_the_exponentials_range(fused, dtype):
    """Gates whose e^-g leaves fp32's normal range (|g| up to 300: silu -> g or -> -0), and 0, +-inf and NaN, in the
    vector body (the first 8 of each row) and in the tail."""
    edge = torch.tensor([-300.0, -120.0, -88.5, -87.5, 0.0, 87.5, 88.5, 120.0, 300.0, float("inf"), float("-inf"),
                         float("nan"), -5.0])
    g = torch.cat([edge, edge.flip(0)]).repeat(3, 1).to(dtype)
    u = (randn(3, g.shape[1], seed=3) + 2).to(dtype)
    torch.testing.assert_close(fused.silu_and_mul(g, u), ref.silu_and_mul(g, u), equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,i", [(13, 2816), (1, 20), (5, 4095)])
def test_silu_and_mul_on_the_halves_of_a_fused_output(fused, dtype, rows, i):
    gate_up = (randn(rows, 2 * i) * 4).to(dtype)  # a fused gate|up linear's output
    g, u = gate_up.chunk(2, dim=-1)  # strided rows, no copy
    got = fused.silu_and_mul(g, u)
    torch.testing.assert_close(got, ref.silu_and_mul(g, u))
    torch.testing.assert_close(got, fused.silu_and_mul(g.contiguous(), u.contiguous()), rtol=0, atol=0)
    assert got.is_contiguous() and got.shape == (rows, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(16, 8, 64), (4, 4, 8)])
def test_rotary_in_place(fused, hq, hk, d, dtype):
    t = 11
    q, k = randn(t, hq, d).to(dtype), randn(t, hk, d, seed=1).to(dtype)
    ang = randn(t, d // 2, seed=2)
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = ref.rotary(q, k, cos, sin)
    got_q, got_k = fused.rotary(q, k, cos, sin)
    exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else {}  # bf16: the reference's roundings, one by one
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)


def test_partial_rotary_takes_the_reference(fused):
    q, k = randn(3, 2, 16), randn(3, 1, 16, seed=1)
    cos, sin = randn(3, 8, seed=2).cos(), randn(3, 8, seed=3).sin()
    want = ref.rotary(q, k, cos, sin)
    got = fused.rotary(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_rejects_other_dtypes(fused):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_and_mul(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))


def test_rejects_mixed_dtypes(fused):
    with pytest.raises(RuntimeError, match="x's dtype"):
        fused.rms_norm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(16, 8, 64), (4, 2, 32)])
def test_rope_and_cache_is_rotary_and_the_cache_write_in_one_call(fused, hq, hk, d, dtype):
    """From the fused projection's output: q rotated out, k rotated and v stored at the slots, as the reference's
    split, rotary and write_kv; the other slots of the caches untouched."""
    from quantkit.engine.rope import rope_table

    t, blocks, block = 9, 6, 16
    qkv = randn(t, (hq + 2 * hk) * d).to(dtype)
    table = rope_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 300, dtype)
    positions = torch.tensor([0, 1, 2, 17, 18, 150, 299, 5, 64])
    slots = torch.randperm(blocks * block, generator=torch.Generator().manual_seed(3))[:t]
    caches = [randn(blocks, block, hk, d, seed=4 + i).to(dtype) for i in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    want_q = ref.rope_and_cache(qkv, positions, table, want_k, want_v, slots, hq, hk)
    got_q = fused.rope_and_cache(qkv, positions, table, caches[0], caches[1], slots, hq, hk)
    exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(caches[0], want_k, **exact)
    assert torch.equal(caches[1], want_v)
    with pytest.raises(RuntimeError, match="outside the table"):
        fused.rope_and_cache(qkv, positions + 1, table, caches[0], caches[1], slots, hq, hk)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.rope_and_cache(qkv, positions, table, caches[0], caches[1], slots + blocks * block, hq, hk)


def test_argmax_rows_is_torchs_argmax(fused):
    """Rows of a vocabulary's width and of widths off the vector length; ties (the first wins), infinities, an
    all -inf row and NaNs (the first NaN wins, as torch's)."""
    for n in (32000, 1, 17, 300):
        x = randn(7, n, seed=n)
        if n > 1:
            x[1, n // 2] = x[1, n - 1] = x[1].max() + 1  # a tie
            x[2, n // 3] = float("inf")
            x[3] = float("-inf")
            x[4, n - 1], x[4, n // 2] = float("nan"), float("nan")
            x[5, 0] = float("nan")
        assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1)), n
    assert torch.equal(fused.argmax_rows(x.double()), x.double().argmax(dim=-1))  # others: torch's
