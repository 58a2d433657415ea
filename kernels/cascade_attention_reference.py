"""Cascade (shared-prefix) attention in pure torch: the test oracle of the C++ cascade path in
paged_attention_cpu.py (SharedPrefix).

Attention over keys A + B equals the two attentions over A and over B merged by their log-sum-exps:
  out = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b),  lse = logaddexp(lse_a, lse_b).
Here A is a group's shared prefix blocks (every member's queries, no mask: the prefix lies before
them) and B the rest of each sequence's cache (causal over its own chunk).
"""

from __future__ import annotations

import torch

from quantkit.kernels.paged_attention_reference import gather_kv


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, D], k/v [L, kv_heads, D], visible bool [n, L] -> out [n, heads, D], lse [n, heads]
    (fp32; a row that sees no key has out 0 and lse -inf)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("nhd,hld->hnl", q.float() * scale, kf)  # [heads, n, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]
    probs = torch.exp(scores - lse[..., None].clamp(min=torch.finfo(torch.float32).min)).nan_to_num(0.0)
    out = torch.einsum("hnl,hld->nhd", probs, vf)
    return out, lse.transpose(0, 1)


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial attentions of the same queries over disjoint keys -> the attention over both."""
    lse = torch.logaddexp(lse_a, lse_b)[..., None]  # [n, heads, 1]
    return torch.exp(lse_a[..., None] - lse) * out_a + torch.exp(lse_b[..., None] - lse) * out_b


def cascade_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: list[int], query_start: list[int],
                                scale: float, skip_blocks: list[int]) -> torch.Tensor:
    """Shapes as paged_attention_cpu's; skip_blocks[s]: leading blocks of s attended as its shared
    prefix (0: none). Returns fp32 out [T, heads, D]."""
    block_size = key_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s, seq_len in enumerate(seq_lens):
        lo, hi = query_start[s], query_start[s + 1]
        n, split = hi - lo, skip_blocks[s] * block_size
        k = gather_kv(key_cache, block_tables[s], seq_len)  # [seq_len, kv_heads, D]
        v = gather_kv(value_cache, block_tables[s], seq_len)
        positions = torch.arange(seq_len - n, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        causal = keys <= positions  # [n, seq_len]
        prefix_out, prefix_lse = attention_with_lse(q[lo:hi], k[:split], v[:split], causal[:, :split], scale)
        rest_out, rest_lse = attention_with_lse(q[lo:hi], k[split:], v[split:], causal[:, split:], scale)
        out[lo:hi] = merge_attention_states(prefix_out, prefix_lse, rest_out, rest_lse)
    return out
