"""Cascade (shared-prefix) attention: the pure-torch reference against the per-sequence reference,
and the C++ path (SharedPrefix from plan_shared_prefix) against the cascade reference."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine.shared_prefix import plan_shared_prefix
from quantkit.kernels.cascade_attention_reference import cascade_attention_reference
from quantkit.kernels.paged_attention_reference import paged_prefill_attention_reference

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)


def shared_case(seq_lens, chunks, prefix_blocks, heads, kv_heads, d, block_size, seed=0, unrelated=()):
    """Random caches; every sequence starts with the same `prefix_blocks` physical blocks, except those
    in `unrelated`, which own all their blocks. Returns q, caches, block ids per sequence, starts."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = prefix_blocks + sum(-(-n // block_size) for n in seq_lens) + 1
    kc = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    shared = [perm.pop() for _ in range(prefix_blocks)]
    block_ids = []
    for i, n in enumerate(seq_lens):
        head = [] if i in unrelated else shared
        block_ids.append(head + [perm.pop() for _ in range(-(-n // block_size) - len(head))])
    q = torch.randn(sum(chunks), heads, d, generator=g)
    starts = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    return q, kc, vc, block_ids, starts


def tables_of(block_ids):
    width = max(len(b) for b in block_ids)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)


def per_sequence_reference(q, kc, vc, tables, seq_lens, starts, scale):
    return torch.cat([paged_prefill_attention_reference(q[starts[i]:starts[i + 1]], kc, vc, tables[i], n, scale)
                      for i, n in enumerate(seq_lens)])


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_reference_merge_equals_plain_attention(skip):
    seq_lens, chunks = [53, 60, 49], [1, 9, 2]
    q, kc, vc, block_ids, starts = shared_case(seq_lens, chunks, 3, 8, 4, 16, 16, seed=1)
    tables = tables_of(block_ids)
    got = cascade_attention_reference(q, kc, vc, tables, seq_lens, starts, 0.25, [skip] * 3)
    want = per_sequence_reference(q, kc, vc, tables, seq_lens, starts, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def run_cascade(attn, seq_lens, chunks, prefix_blocks, heads, kv_heads, d, block_size, seed=0, unrelated=(),
                dtype=torch.float32):
    q, kc, vc, block_ids, starts = shared_case(seq_lens, chunks, prefix_blocks, heads, kv_heads, d, block_size,
                                               seed, unrelated)
    tables, scale = tables_of(block_ids), d ** -0.5
    shared = plan_shared_prefix(seq_lens, chunks, tables, block_size)
    assert shared is not None
    got = attn(q.to(dtype), kc.to(dtype), vc.to(dtype), tables, torch.tensor(seq_lens, dtype=torch.int32),
               torch.tensor(starts, dtype=torch.int32), scale, shared)
    want = cascade_attention_reference(q, kc, vc, tables, seq_lens, starts, scale, shared.skip_blocks.tolist())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    return shared


@pytest.mark.parametrize("heads,kv_heads,d,block_size", [
    (16, 8, 64, 16),  # the vLLM comparison's shape
    (8, 4, 8, 16),  # stories260K's
    (6, 2, 20, 4),  # head_dim not a power of two
    (4, 4, 32, 8),  # no GQA
])
def test_decodes_sharing_a_prefix(attn, heads, kv_heads, d, block_size):
    p = 4
    seq_lens = [p * block_size + k for k in (1, 2, 5, block_size, block_size + 3)]
    shared = run_cascade(attn, seq_lens, [1] * len(seq_lens), p, heads, kv_heads, d, block_size)
    assert shared.skip_blocks.tolist() == [p] * len(seq_lens)


def test_many_decodes_span_several_prefix_tiles(attn):
    """70 sequences: the shared pass splits their queries into tiles of 32."""
    seq_lens = [8 * 16 + 1 + i % 7 for i in range(70)]
    run_cascade(attn, seq_lens, [1] * 70, 8, 16, 8, 64, 16, seed=2)


def test_prefill_chunks_after_a_prefix_hit(attn):
    """Chunks of new prompt tokens over the cached prefix, decodes in the same call, and a prefix that
    ends right at a first query (position prefix_len - 1 is the last prefix key it sees)."""
    block_size, p = 16, 3
    seq_lens = [p * block_size + 20, p * block_size + 40, p * block_size + 1, p * block_size]
    chunks = [20, 17, 1, 1]
    shared = run_cascade(attn, seq_lens, chunks, p, 16, 8, 64, block_size, seed=4)
    assert shared.skip_blocks.tolist() == [p] * 4


@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_avx512_paths_after_a_prefix_hit(attn, avx512_step, d, dtype):
    """The shared pass (70 queries: two tiles) and the per-sequence pass, by both paths of the vector step."""
    seq_lens = [3 * 16 + 1 + i % 5 for i in range(60)] + [3 * 16 + 30]
    run_cascade(attn, seq_lens, [1] * 60 + [10], 3, 8, 4, d, 16, seed=8, dtype=dtype)


def test_unrelated_sequence_keeps_its_blocks(attn):
    seq_lens, chunks = [70, 75, 66], [1, 1, 1]
    shared = run_cascade(attn, seq_lens, chunks, 4, 8, 4, 32, 16, seed=5, unrelated=(1,))
    assert shared.skip_blocks.tolist() == [4, 0, 4]


def test_bfloat16_within_rounding(attn):
    run_cascade(attn, [40, 45, 50], [1, 5, 1], 2, 8, 4, 32, 16, seed=6, dtype=torch.bfloat16)


def test_a_prefix_past_the_first_query_raises(attn):
    """Skipped blocks get no causal mask: a plan whose prefix reaches past a query's position is refused."""
    from quantkit.kernels.paged_attention_cpu import PrefixGroup, SharedPrefix

    q, kc = torch.zeros(2, 4, 8), torch.zeros(4, 4, 2, 8)
    tables = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    lens, starts = torch.tensor([6, 6], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    two = torch.tensor([0, 1], dtype=torch.int32)
    too_long = SharedPrefix([PrefixGroup(blocks=two, tokens=two)], skip_blocks=torch.tensor([2, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not all visible"):
        attn(q, kc, kc, tables, lens, starts, 1.0, too_long)
