"""Paged attention on CPU in C++ (kernels/csrc/paged_attention_cpu.cpp, extension `quantkit_attn`):
one call per layer and step for every sequence's chunk, decodes (chunks of one) and prefills over
cached prefix blocks alike, reading the paged cache in place.

The reference is paged_attention_reference.py (per sequence: `paged_prefill_attention_reference`,
whose exact causal mask covers chunks of any length, one included). Where the extension does not
build, `cpu_attention()` returns None and the reason is logged once; the engine keeps the torch path.

Cascade (shared-prefix) attention: when several sequences start with the same cache blocks (a prefix
cache hit), `SharedPrefix` names those blocks and the sequences' query rows. A first pass
(`shared_prefix_state_` in the C++ file) runs all those queries over the shared blocks (per kv head
and tile of 64 queries: their query rows of every member sequence against the prefix keys, by the
AVX-512 step's widened blocks, else in GEMMs), so the prefix is read once per tile of sequences;
the per-sequence pass then skips those blocks and continues the online softmax from the first
pass's state, which is the log-sum-exp merge of the two parts. The reference is cascade_attention_reference.py.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension

log = logging.getLogger("quantkit.kernels")
EXTENSION = "quantkit_attn"
SOURCES = ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp")  # one module; fused ops: cpu_fused.py


@dataclass(frozen=True)
class PrefixGroup:
    blocks: torch.Tensor  # int32 [P]: the cache blocks every member sequence starts with
    tokens: torch.Tensor  # int32 [Q]: the flat-batch query rows of the member sequences


@dataclass(frozen=True)
class SharedPrefix:
    """Which sequences of a step share leading cache blocks; each of those blocks must be visible to
    every query of its members (all keys of the prefix lie at or before the member's first query)."""

    groups: list[PrefixGroup]
    skip_blocks: torch.Tensor  # int32 [S]: leading blocks of sequence s covered by its group (0: none)


_NONE_I32 = torch.empty(0, dtype=torch.int32)
_NONE_F32 = torch.empty(0, dtype=torch.float32)


def cpu_attention():
    """The compiled extension, or None (the reason logged once per reason)."""
    mod = load_cpu_extension(EXTENSION, SOURCES)
    if mod is None:
        _say_once(cpu_extension_unavailable(EXTENSION))
    return mod


@functools.cache
def _say_once(why: str | None) -> None:
    log.warning("paged attention: torch path (C++ kernel unavailable: %s)", why)


def paged_attention_cpu(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                        scale: float, shared: SharedPrefix | None = None) -> torch.Tensor:
    """q [T, heads, D]; caches [num_blocks, block_size, kv_heads, D]; block_tables int32 [S, max_blocks];
    seq_lens int32 [S] (cache tokens, this step's included); query_start int32 [S + 1] (sequence s owns
    q[query_start[s]:query_start[s + 1]]); shared: the step's shared prefix blocks, run as cascade
    attention -> out [T, heads, D] in q's dtype. Raises RuntimeError with the reason on inconsistent
    shapes."""
    mod = cpu_attention()
    if mod is None:
        raise RuntimeError(f"{EXTENSION} is unavailable: {cpu_extension_unavailable(EXTENSION)}")
    q = q.contiguous()
    if shared is None or not shared.groups:
        return mod.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start, scale,
                                   _NONE_I32, _NONE_F32, _NONE_F32, _NONE_F32)
    # the online-softmax state after the shared blocks, fp32: acc [T, heads, D], max and sum [T, heads]
    acc = torch.empty(q.shape, dtype=torch.float32)
    m = torch.empty(q.shape[:2], dtype=torch.float32)
    l = torch.empty(q.shape[:2], dtype=torch.float32)
    for g in shared.groups:
        mod.shared_prefix_state_(q, key_cache, value_cache, g.blocks, g.tokens, scale, acc, m, l)
    return mod.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start, scale,
                               shared.skip_blocks, acc, m, l)
