"""Random kernel inputs shared by the kernel tests (CPU, interpreter) and their `gpu`-marked twins."""

from __future__ import annotations

import torch

from quantkit.format.packing import PackedLinear, pack
from quantkit.format.primitives import QuantizedWeight, QuantScheme, default_g_idx
from quantkit.kernels.paged_attention_reference import write_kv


def random_packed(layout: str, group: int, act_order: bool, n: int, k: int, seed: int = 0) -> PackedLinear:
    """Random codes, zeros and fp16 scales packed in `layout` (v1 zeros kept >= 1: it stores zero - 1)."""
    gen = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(bits=4, group_size=group, sym=False)
    groups = scheme.num_groups(k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)  # [N, K]
    zeros = torch.randint(1 if layout == "gptq" else 0, 16, (groups, n), generator=gen).float()  # [G, N]
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.002).half().float()  # [G, N]
    g_idx = default_g_idx(k, scheme)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()  # groups no longer follow K
    bias = torch.randn(n, generator=gen)
    return pack(QuantizedWeight(codes, scales, zeros, g_idx, scheme), layout, bias=bias)


def random_paged(seq_lens, heads, kv_heads, d, block_size, num_blocks, seed=0):
    """Random caches, a random permutation of blocks per sequence, and each sequence's dense k/v."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(num_blocks, block_size, kv_heads, d)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    dense = []
    for i, n in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kv_heads, d, generator=g)
        v = torch.randn(n, kv_heads, d, generator=g)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(kc, vc, k, v, slots)
        dense.append((k, v))
    return kc, vc, tables, dense

