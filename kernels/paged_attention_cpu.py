"""Paged attention on CPU in C++ (kernels/csrc/paged_attention_cpu.cpp, extension `quantkit_attn`):
one call per layer and step for every sequence's chunk, decodes (chunks of one) and prefills over
cached prefix blocks alike, reading the paged cache in place.

The reference is paged_attention_reference.py (per sequence: `paged_prefill_attention_reference`,
whose exact causal mask covers chunks of any length, one included). Where the extension does not
build, `cpu_attention()` returns None and the reason is logged once; the engine keeps the torch path.
"""

from __future__ import annotations

import functools
import logging

import torch

from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension

log = logging.getLogger("quantkit.kernels")
EXTENSION = "quantkit_attn"
SOURCES = ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp")  # one module; fused ops: cpu_fused.py


@functools.cache
def cpu_attention():
    """The compiled extension, or None (the reason logged once)."""
    mod = load_cpu_extension(EXTENSION, SOURCES)
    if mod is None:
        log.warning("paged attention: torch path (C++ kernel unavailable: %s)", cpu_extension_unavailable(EXTENSION))
    return mod


def paged_attention_cpu(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [T, heads, D]; caches [num_blocks, block_size, kv_heads, D]; block_tables int32 [S, max_blocks];
    seq_lens int32 [S] (cache tokens, this step's included); query_start int32 [S + 1] (sequence s owns
    q[query_start[s]:query_start[s + 1]]) -> out [T, heads, D] in q's dtype. Raises RuntimeError
    with the reason on inconsistent shapes."""
    mod = cpu_attention()
    if mod is None:
        raise RuntimeError(f"{EXTENSION} is unavailable: {cpu_extension_unavailable(EXTENSION)}")
    return mod.paged_attention(q.contiguous(), key_cache, value_cache, block_tables, seq_lens, query_start, scale)
