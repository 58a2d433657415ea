"""Attention over a paged KV cache in pure torch: the CPU path of the engine and the test oracle
of the Triton kernel in paged_attention.py.

Cache layout, per layer:
  key_cache, value_cache  [num_blocks, block_size, kv_heads, head_dim]
  block_tables            int32 [num_seqs, max_blocks]  (row i: the blocks of sequence i, in order;
                                                          unused entries are ignored)
  seq_lens                int32 [num_seqs]  tokens in the cache for each sequence, this step's included
A token at position p of sequence i lives in block block_tables[i, p // block_size], row p % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots [T] (slot = block * block_size + row)."""
    num_blocks, block_size = key_cache.shape[:2]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n = -(-length // block_size)
    # index_select, not cache[idx]: on CPU it is several times faster for whole-block rows
    return cache.index_select(0, block_table[:n].long()).reshape(n * block_size, *cache.shape[2:])[:length]


def gather_kv_range(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, int]:
    """Tokens start .. end - 1 of one sequence, from the block holding `start` on: ([n, kv_heads, head_dim],
    the position of its first row, a block boundary at or before `start`)."""
    block_size = cache.shape[1]
    first = start // block_size
    n = -(-end // block_size) - first
    rows = cache.index_select(0, block_table[first:first + n].long()).reshape(n * block_size, *cache.shape[2:])
    return rows[:end - first * block_size], first * block_size


def paged_masked_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_table: torch.Tensor, seq_len: int, scale: float, window: int | None = None,
                                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's chunk q [n, heads, head_dim] (positions seq_len - n .. seq_len - 1) under a sliding window,
    logit soft-capping and/or attention sinks, as transformers computes them: the query at position p sees keys j
    with p - window < j <= p (every j <= p without a window); with `softcap` c the scores s = q.k * scale become
    c * tanh(s / c) before the softmax (fp32); `sinks` [heads] (gpt-oss) adds one logit per head to each softmax's
    denominator, a key that no value goes with. Only the blocks the window reaches are read. -> [n, heads, D]."""
    n, heads = q.shape[0], q.shape[1]
    first_query = seq_len - n
    start = 0 if window is None else max(0, first_query - window + 1)
    k, base = gather_kv_range(key_cache, block_table, start, seq_len)  # [L, kv_heads, D] from position `base`
    v, _ = gather_kv_range(value_cache, block_table, start, seq_len)
    rows = torch.arange(n, device=q.device)[:, None] + first_query  # [n, 1] query positions
    cols = torch.arange(k.shape[0], device=q.device)[None, :] + base  # [1, L] key positions
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    qt, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads | kv_heads, ., D]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(qt, k, v, attn_mask=visible, scale=scale, enable_gqa=True).transpose(0, 1)
    rep = heads // k.shape[0]
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scores = (qt @ k.transpose(1, 2)) * scale  # [heads, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf")).float()
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, n, 1)  # [heads, n, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs.to(q.dtype) @ v).transpose(0, 1)


def paged_prefill_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                      block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's chunk of queries. q [n, heads, head_dim] holds positions seq_len - n .. seq_len - 1.

    Exact causal masking for chunked prefill: query i sees keys 0 .. seq_len - n + i.
    """
    n = q.shape[0]
    k = gather_kv(key_cache, block_table, seq_len).transpose(0, 1)  # [kv_heads, seq_len, D]
    v = gather_kv(value_cache, block_table, seq_len).transpose(0, 1)
    qt = q.transpose(0, 1)  # [heads, n, D]
    if n == seq_len:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(n, device=q.device)[:, None] + (seq_len - n)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # [n, seq_len]
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_decode_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """One new token per sequence. q [B, heads, head_dim] -> [B, heads, head_dim].

    All sequences at once: gather block_tables' blocks ([B, max_blocks * block_size] keys)
    and mask the keys at positions >= seq_len.
    """
    b, heads, d = q.shape
    max_blocks = block_tables.shape[1]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    idx = block_tables.long().clamp(min=0).flatten()
    length = max_blocks * block_size
    k = key_cache.index_select(0, idx).view(b, length, kv_heads, d).transpose(1, 2)  # [B, kvh, L, D]
    v = value_cache.index_select(0, idx).view(b, length, kv_heads, d).transpose(1, 2)
    positions = torch.arange(length, device=q.device)
    beyond = positions[None, :] >= seq_lens[:, None].to(q.device)  # [B, L]: padding past each sequence
    # an additive mask (0 / -inf) takes a faster SDPA path on CPU than a boolean one, same result
    mask = torch.zeros(b, 1, 1, length, dtype=q.dtype, device=q.device).masked_fill(beyond[:, None, None, :],
                                                                                     float("-inf"))
    # GQA without expanding k/v: the `group` query heads of one kv head become `group` query rows
    group = heads // kv_heads
    out = F.scaled_dot_product_attention(q.view(b, kv_heads, group, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, d)
