"""Paged attention: the Triton decode kernel (under TRITON_INTERPRET=1) against the torch reference,
and the torch reference against plain dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels.paged_attention_reference import (
    paged_decode_attention_reference,
    paged_masked_attention_reference,
    paged_prefill_attention_reference,
)
from tests_support.kernel_inputs import random_paged


@pytest.fixture(scope="module")
def kernel():
    """A private copy of quantkit.kernels.paged_attention decorated under TRITON_INTERPRET=1.

    `@triton.jit` reads the variable when it decorates, so the copy runs in the interpreter (no GPU
    here) while the variable never leaks into other tests or the real module.
    """
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from quantkit.kernels.triton_w4a16 import private_copy

    module = private_copy("quantkit.kernels.paged_attention", interpret=True)
    assert isinstance(module._paged_decode_kernel, InterpretedFunction)
    return module


def dense_attention(q, k, v, scale, causal_offset):
    """q [n, H, D], k/v [L, Hkv, D]; query i sees keys 0 .. causal_offset + i. Naive, fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + causal_offset
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(8, 4, 8, 16), (4, 4, 32, 8), (6, 2, 20, 4)])
def test_decode_reference_matches_dense(heads, kv_heads, d, block_size):
    seq_lens = [1, 5, 17, 40]
    kc, vc, tables, dense = random_paged(seq_lens, heads, kv_heads, d, block_size, num_blocks=64)
    q = torch.randn(len(seq_lens), heads, d)
    out = paged_decode_attention_reference(q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), d ** -0.5)
    for i, (n, (k, v)) in enumerate(zip(seq_lens, dense)):
        want = dense_attention(q[i:i + 1], k, v, d ** -0.5, causal_offset=n - 1)
        torch.testing.assert_close(out[i:i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_len,chunk", [(23, 23), (23, 7), (33, 1), (16, 16)])
def test_prefill_reference_exact_causal_mask_for_chunks(seq_len, chunk):
    """A chunk of the last `chunk` positions sees the cached prefix and its own earlier tokens only."""
    heads, kv_heads, d, bs = 4, 2, 16, 8
    kc, vc, tables, dense = random_paged([seq_len], heads, kv_heads, d, bs, num_blocks=16, seed=3)
    q = torch.randn(chunk, heads, d)
    out = paged_prefill_attention_reference(q, kc, vc, tables[0], seq_len, d ** -0.5)
    want = dense_attention(q, *dense[0], d ** -0.5, causal_offset=seq_len - chunk)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def dense_masked_attention(q, k, v, scale, causal_offset, window, softcap, sinks=None):
    """dense_attention with a sliding window (query at p sees p - window < j <= p) and scores capped to
    c * tanh(s / c): transformers' eager attention for Gemma, naive, fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[0])[:, None] + causal_offset
    keys = torch.arange(k.shape[0])[None, :]
    mask = (keys <= pos) & ((keys > pos - window) if window is not None else True)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # gpt-oss: exp(sink) joins each head's denominator
        denominator = scores.exp().sum(-1, keepdim=True) + sinks.double().exp()[:, None, None]
        return torch.einsum("hnl,lhd->nhd", scores.exp() / denominator, v).float()
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("seq_len,chunk,window,softcap", [
    (40, 40, 8, None), (40, 5, 8, None), (41, 1, 16, None), (23, 1, 30, None),  # window past the start
    (40, 9, None, 2.0), (40, 1, 7, 1.5), (33, 33, 5, 3.0)])
def test_masked_reference_honours_the_window_and_the_cap(seq_len, chunk, window, softcap):
    heads, kv_heads, d, bs = 4, 2, 16, 8
    kc, vc, tables, dense = random_paged([seq_len], heads, kv_heads, d, bs, num_blocks=16, seed=5)
    q = torch.randn(chunk, heads, d, generator=torch.Generator().manual_seed(1)) * 3  # scores large enough to cap
    out = paged_masked_attention_reference(q, kc, vc, tables[0], seq_len, d ** -0.5, window, softcap)
    want = dense_masked_attention(q, *dense[0], d ** -0.5, seq_len - chunk, window, softcap)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if window is not None and seq_len - chunk >= window:  # it does differ from full causal attention
        full = dense_masked_attention(q, *dense[0], d ** -0.5, seq_len - chunk, None, softcap)
        assert not torch.allclose(out, full, atol=1e-3)


@pytest.mark.parametrize("seq_len,chunk,window", [(40, 40, 8), (40, 5, None), (41, 1, 16), (9, 1, None)])
def test_masked_reference_adds_each_heads_sink_to_the_softmax(seq_len, chunk, window):
    heads, kv_heads, d, bs = 4, 2, 16, 8
    kc, vc, tables, dense = random_paged([seq_len], heads, kv_heads, d, bs, num_blocks=16, seed=6)
    q = torch.randn(chunk, heads, d, generator=torch.Generator().manual_seed(2)) * 2
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    out = paged_masked_attention_reference(q, kc, vc, tables[0], seq_len, d ** -0.5, window, None, sinks)
    want = dense_masked_attention(q, *dense[0], d ** -0.5, seq_len - chunk, window, None, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    plain = dense_masked_attention(q, *dense[0], d ** -0.5, seq_len - chunk, window, None)
    assert not torch.allclose(out, plain, atol=1e-2)  # the sinks take weight from every key


@pytest.mark.parametrize("heads,kv_heads,d,block_size,dtype", [
    (8, 4, 8, 16, torch.float32),  # stories260K's shape
    (4, 2, 32, 16, torch.float32),
    (6, 2, 20, 4, torch.float32),  # head_dim not a power of two
    (4, 4, 16, 8, torch.bfloat16),
])
def test_triton_decode_matches_reference(kernel, heads, kv_heads, d, block_size, dtype):
    seq_lens = [1, 3, block_size, block_size + 1, 3 * block_size + 5]
    kc, vc, tables, _ = random_paged(seq_lens, heads, kv_heads, d, block_size, num_blocks=48, seed=1)
    kc, vc = kc.to(dtype), vc.to(dtype)
    q = torch.randn(len(seq_lens), heads, d).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = kernel.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5)
    want = paged_decode_attention_reference(q.float(), kc.float(), vc.float(), tables, lens, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_triton_decode_rejects_bad_shapes(kernel):
    paged_decode_attention = kernel.paged_decode_attention
    kc = torch.zeros(4, 16, 3, 8)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.zeros(1, 4, 8), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="power of two"):
        kc = torch.zeros(4, 12, 2, 8)
        paged_decode_attention(torch.zeros(1, 4, 8), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0)


def test_sdpa_reference_equals_dense_on_full_prefill():
    """The is_causal fast path (no prefix) agrees with the explicit mask path."""
    kc, vc, tables, dense = random_paged([12], 4, 2, 8, 4, num_blocks=8, seed=5)
    q = torch.randn(12, 4, 8)
    out = paged_prefill_attention_reference(q, kc, vc, tables[0], 12, 8 ** -0.5)
    k, v = dense[0]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=8 ** -0.5, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, want)
