"""Attention metadata for one engine step, and attention over the paged cache.

The metadata is built once per step by the model runner and passed explicitly to every layer
(no module-global context). On CPU, where the C++ kernel builds (quantkit.kernels.paged_attention_cpu),
one call per layer covers every sequence, reading the paged cache in place, with the blocks that
several sequences share (prefix cache hits) attended once for all of them (cascade attention,
quantkit.engine.shared_prefix). Otherwise sequences whose
chunk is a single token (decodes) run batched; longer chunks (prefills, possibly chunked, possibly
after a prefix hit) run one by one with exact causal masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.engine.shared_prefix import plan_shared_prefix
from quantkit.kernels.paged_attention_cpu import SharedPrefix, cpu_attention, paged_attention_cpu
from quantkit.kernels.paged_attention_reference import (
    paged_decode_attention_reference,
    paged_masked_attention_reference,
    paged_prefill_attention_reference,
    write_kv,
)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each scheduled token
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: list[int]  # [B] tokens in the cache after this step
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's tokens in the flat batch
    decode_rows: torch.Tensor  # int64 [D]: sequences whose chunk is one token
    decode_tokens: torch.Tensor  # int64 [D]: their token index in the flat batch
    decode_seq_lens: torch.Tensor  # int32 [D]
    prefill_rows: list[int]  # sequences with longer chunks
    decode_buckets: list[tuple[torch.Tensor, int]]  # (rows of the decode arrays, blocks they need); CPU path
    seq_lens_t: torch.Tensor | None = None  # int32 [B]; set when the C++ CPU kernel runs the step
    query_start_t: torch.Tensor | None = None  # int32 [B + 1]; likewise
    shared_prefix: SharedPrefix | None = None  # blocks several sequences share; C++ CPU kernel only


DECODE_BUCKET = 16  # CPU: decodes attended together, by length, so padding to the longest stays small


def decode_buckets(seq_lens: list[int], block_size: int, device: torch.device) -> list[tuple[torch.Tensor, int]]:
    """Decodes sorted by length in groups of DECODE_BUCKET, each with the block count of its longest.

    The torch path gathers every sequence's blocks up to the longest one's count: in buckets of
    similar length, the gather and the masked attention shrink to about the real lengths.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups = [order[i:i + DECODE_BUCKET] for i in range(0, len(order), DECODE_BUCKET)]
    return [(torch.tensor(rows, dtype=torch.int64, device=device), -(-max(seq_lens[r] for r in rows) // block_size))
            for rows in groups]


def block_table(block_ids: list[list[int]]) -> torch.Tensor:
    """int32 [B, max blocks], rows zero-padded."""
    width = max(len(b) for b in block_ids)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)


def slot_mapping(seq_lens: list[int], query_lens: list[int], block_ids: list[list[int]], block_size: int) -> list[int]:
    """The cache slot (block * block_size + row) of every scheduled token, sequences back to back."""
    slots: list[int] = []
    for seq_len, n, blocks in zip(seq_lens, query_lens, block_ids):
        pos = seq_len - n
        while pos < seq_len:  # whole runs of one block at a time
            run = min(seq_len, (pos // block_size + 1) * block_size)
            base = blocks[pos // block_size] * block_size - (pos // block_size) * block_size
            slots.extend(range(base + pos, base + run))
            pos = run
    return slots


def use_cpu_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """The C++ kernel runs fp32 and bf16 CPU caches (softmax and accumulation in fp32 either way)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_attention() is not None


def build_metadata(seq_lens: list[int], query_lens: list[int], block_ids: list[list[int]], block_size: int,
                   device: torch.device, dtype: torch.dtype = torch.float32,
                   table: torch.Tensor | None = None) -> AttentionMetadata:
    """Flat-batch metadata from each sequence's cache length, chunk length and block ids; `dtype` is
    the cache's. `table` is the same block ids as a CPU block table (the KV cache manager keeps one:
    KVCacheManager.block_table); without it, it is built from the lists."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = torch.tensor(slot_mapping(seq_lens, query_lens, block_ids, block_size), dtype=torch.int64, device=device)
    table = block_table(block_ids) if table is None else table
    cpu_table, table = table, table.to(device)
    if use_cpu_kernel(device, dtype):  # one kernel call per layer: no decode/prefill split
        empty = torch.empty(0, dtype=torch.int64)
        return AttentionMetadata(slots, table, list(seq_lens), starts, empty, empty, empty.int(), [], [],
                                 seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
                                 query_start_t=torch.tensor(starts, dtype=torch.int32),
                                 shared_prefix=plan_shared_prefix(seq_lens, query_lens, cpu_table, block_size))
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    decode_lens = [seq_lens[i] for i in decodes]
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=table,
        seq_lens=list(seq_lens),
        query_start_loc=starts,
        decode_rows=torch.tensor(decodes, dtype=torch.int64, device=device),
        decode_tokens=torch.tensor([starts[i] for i in decodes], dtype=torch.int64, device=device),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
        prefill_rows=[i for i, n in enumerate(query_lens) if n != 1],
        decode_buckets=decode_buckets(decode_lens, block_size, device),
    )


def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, buckets: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
    """Decode attention; on CPU in length buckets (`decode_buckets`, built once per step by build_metadata)."""
    if q.is_cuda:
        from quantkit.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale)
    if buckets is None:
        buckets = decode_buckets(seq_lens.tolist(), key_cache.shape[1], q.device)
    if len(buckets) == 1:
        return paged_decode_attention_reference(q, key_cache, value_cache, block_tables[:, :buckets[0][1]],
                                                seq_lens, scale)
    out = torch.empty_like(q)
    for rows, width in buckets:
        out[rows] = paged_decode_attention_reference(q[rows], key_cache, value_cache, block_tables[rows, :width],
                                                     seq_lens[rows], scale)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] of this step's tokens -> [T, heads, D].

    Writes k/v into the cache first, so each query also sees the keys of its own chunk.
    """
    write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    return attend(q, key_cache, value_cache, meta, scale)


def attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """q [T, heads, D] of this step's tokens, whose k/v the cache already holds -> [T, heads, D]."""
    if meta.seq_lens_t is not None:
        return paged_attention_cpu(q, key_cache, value_cache, meta.block_tables, meta.seq_lens_t,
                                   meta.query_start_t, scale, meta.shared_prefix)
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        tables = meta.block_tables[meta.decode_rows]
        out[meta.decode_tokens] = _decode(q[meta.decode_tokens], key_cache, value_cache, tables,
                                          meta.decode_seq_lens, scale, meta.decode_buckets)
    for i in meta.prefill_rows:
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[s:e] = paged_prefill_attention_reference(q[s:e], key_cache, value_cache, meta.block_tables[i],
                                                     meta.seq_lens[i], scale)
    return out


def attend_masked(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` for layers with a sliding window, logit soft-capping or sinks (Gemma 3's sliding layers, Mistral,
    Phi-3, gpt-oss), which the C++ kernel does not compute: torch, one sequence at a time, reading only the blocks
    in the window (paged_masked_attention_reference). q [T, heads, D] -> [T, heads, D]."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        out[s:e] = paged_masked_attention_reference(q[s:e], key_cache, value_cache, meta.block_tables[i], seq_len,
                                                    scale, window, softcap, sinks)
    return out
