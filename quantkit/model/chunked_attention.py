"""Eager attention a block of queries at a time, for calibration runs of models whose attention transformers computes
only eagerly (gpt-oss: its per-head sinks join each softmax, which SDPA does not take).

transformers' eager attention materializes every score of a run: [batch, heads, queries, keys] fp32, several times
over (the scores, the masked, the sink-joined, the softmax). For gpt-oss-20b (64 heads) a calibration run of 8 x 512
tokens holds 0.5 GB per such tensor, and at 2 x 2048 tokens 2.1 GB; a layer of the calibration then peaks at
several GB on attention alone. Computed `QUERY_BLOCK_BYTES` of scores at a time, the same arithmetic per query row
(scores, mask, sinks, softmax, weighted values) holds one block's.

`register()` adds it (and eager attention's masks) to transformers' attention functions under ATTENTION_NAME, when a
model that needs it is built, for `AutoModelForCausalLM.from_config(..., attn_implementation=ATTENTION_NAME)`.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "quantkit_query_blocks"
QUERY_BLOCK_BYTES = 64 * 2**20  # fp32 scores of one block of queries against every key


def query_block_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                          s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [b, heads, q, d], key/value [b, kv_heads, k, d], the additive
    mask [b, 1, q, k] (the sliding window already in it), `s_aux` gpt-oss's sinks [heads] -> ([b, q, heads, d], None).
    Eval only (no dropout)."""
    b, heads, q_len, _ = query.shape
    rep = heads // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)  # [b, heads, k, d]
    rows = max(1, QUERY_BLOCK_BYTES // (4 * b * heads * key.shape[2]))
    out = torch.empty_like(query)
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        scores = torch.matmul(query[:, :, start:end], key.transpose(2, 3)) * scaling  # [b, heads, rows, k]
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, start:end, : key.shape[2]]
        if s_aux is not None:  # the sink: one more logit per head in the denominator, no value
            sink = s_aux.reshape(1, -1, 1, 1).expand(b, -1, end - start, 1).to(scores.dtype)
            scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
        if s_aux is not None:
            probs = probs[..., :-1]
        out[:, :, start:end] = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Add query_block_attention to transformers' attention functions, with eager attention's additive masks (else
    transformers builds none for an unknown name), idempotently; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, query_block_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    return ATTENTION_NAME
