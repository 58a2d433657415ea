"""Paged-attention decode kernel (Triton): one new query token per sequence, keys and values read
block by block through the block table, softmax computed online (running max and sum) in fp32.

Grid: (num_seqs, num_heads). Each program owns one query head of one sequence; GQA maps it to
kv head `head // (num_heads // num_kv_heads)`. It walks cdiv(seq_len, BLOCK_SIZE) blocks: load
the block's keys [BLOCK_SIZE, D], score them against q, mask positions >= seq_len, rescale the
running accumulator, and add the block's values weighted by the new probabilities.

The pure-torch oracle is `paged_decode_attention_reference` in paged_attention_reference.py;
tests run this kernel under TRITON_INTERPRET=1 and compare. So that a copy of this module decorated
under the interpreter runs even though triton itself was imported without the variable, the kernel
calls only builtins of triton.language (tl.full, tl.reduce with our own combine functions, integer
arithmetic): the @jit helpers of triton's standard library (tl.zeros, tl.sum, tl.max, tl.cdiv) were
decorated at triton's import and cannot run inside the interpreter otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _paged_decode_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    # q [B, H, D] and out [B, H, D] strides
    stride_qb, stride_qh, stride_ob, stride_oh,
    # cache [num_blocks, BLOCK_SIZE, kv_heads, D] strides (k and v share them)
    stride_cb, stride_ct, stride_ch,
    # block_tables [B, max_blocks] row stride
    stride_tb,
    scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.full([1], 0.0, dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    for i in range(0, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_tb + i).to(tl.int64)
        t_mask = i * BLOCK_SIZE + t < seq_len
        offs = block * stride_cb + t[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, BLOCK_D]
        s = tl.reduce(k * q[None, :], 1, _add) * scale  # [BLOCK_SIZE]
        s = tl.where(t_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 0, _maximum))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.reduce(p[:, None] * v, 0, _add)
        l_i = l_i * alpha + tl.reduce(p, 0, _add)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D]; caches [num_blocks, block_size, kv_heads, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B] (each >= 1) -> out [B, heads, D] in q's dtype."""
    b, heads, d = q.shape
    num_blocks, block_size, kv_heads, d_cache = key_cache.shape
    if d_cache != d or value_cache.shape != key_cache.shape:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not fit q {tuple(q.shape)}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two for the Triton kernel")
    if block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError("block_tables and seq_lens need one row per sequence")
    q = q.contiguous()
    key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    _paged_decode_kernel[(b, heads)](
        q, key_cache, value_cache, block_tables, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        scale,
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )
    return out
