"""The C++ CPU paged attention (extension quantkit_attn) against the pure-torch reference: decodes,
prefills over cached prefix blocks, and both in one call."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.paged_attention_reference import paged_prefill_attention_reference
from tests_support.kernel_inputs import random_paged

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)


def reference(q, kc, vc, tables, seq_lens, chunks, scale):
    """Per sequence through the torch reference; chunks[i] queries end at seq_lens[i]."""
    outs, start = [], 0
    for i, (n, c) in enumerate(zip(seq_lens, chunks)):
        outs.append(paged_prefill_attention_reference(q[start:start + c], kc, vc, tables[i], n, scale))
        start += c
    return torch.cat(outs)


def run_case(attn, seq_lens, chunks, heads, kv_heads, d, block_size, dtype=torch.float32, seed=0):
    kc, vc, tables, _ = random_paged(seq_lens, heads, kv_heads, d, block_size, num_blocks=96, seed=seed)
    q = torch.randn(sum(chunks), heads, d, generator=torch.Generator().manual_seed(seed + 1))
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = attn(q.to(dtype), kc.to(dtype), vc.to(dtype), tables, lens, starts, d ** -0.5)
    want = reference(q, kc, vc, tables, seq_lens, chunks, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads,kv_heads,d,block_size", [
    (16, 8, 64, 16),  # the vLLM comparison's shape
    (12, 4, 32, 16),  # groups of 3 query heads: a pair of rows folded together, then one alone
    (8, 4, 8, 16),  # stories260K's
    (6, 2, 20, 4),  # head_dim not a power of two
    (4, 4, 32, 8),  # no GQA
])
def test_decode_matches_reference(attn, heads, kv_heads, d, block_size):
    seq_lens = [1, 3, block_size, block_size + 1, 3 * block_size + 5]
    run_case(attn, seq_lens, [1] * len(seq_lens), heads, kv_heads, d, block_size)


@pytest.mark.parametrize("seq_len,chunk", [(23, 23), (23, 7), (40, 17), (33, 1), (16, 16), (70, 40)])
def test_prefill_over_cached_prefix_matches_reference(attn, seq_len, chunk):
    """The chunk's queries see the cached prefix and their own chunk causally (tiles of 16 queries
    cross block boundaries at 40 and 70)."""
    run_case(attn, [seq_len], [chunk], 8, 2, 32, 8, seed=3)


def test_decodes_and_prefills_in_one_call(attn):
    run_case(attn, [5, 40, 17, 64, 9], [1, 12, 1, 64, 9], 16, 8, 64, 16, seed=5)


@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_avx512_paths_match_reference(attn, avx512_step, d, dtype):
    """Decodes (4 rows an item) and prefill tiles crossing blocks (up to 64 rows, causal within a block),
    block 16, every head dim the vector step takes; 150 keys are three of the AMX step's 4-block steps."""
    run_case(attn, [5, 40, 17, 64, 33, 150], [1, 12, 17, 64, 9, 30], 8, 2, d, 16, dtype=dtype, seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(8, 2, 64, 16), (6, 2, 40, 48), (12, 4, 24, 8)])
def test_prefill_tiles_fold_keys_across_blocks(attn, dtype, heads, kv_heads, d, block_size):
    """Prefill tiles of many rows (the AVX2 step where no AVX-512 one runs: 64 keys a step, gathered across blocks,
    rows two at a time and one alone): whole prompts and chunks over a cached prefix, head dims in eights but not in
    32s, blocks that a step's 64 keys cut in the middle, odd rows per tile (groups of 3)."""
    run_case(attn, [150, 77, 200], [150, 30, 64], heads, kv_heads, d, block_size, dtype=dtype, seed=21)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_blocks_of_32_keys_fold_16_keys_at_a_time(attn, dtype, d):
    """The few-rows step takes up to 16 keys at once: a block of 32 is two steps of the online softmax, with
    the cut at every place a sequence can end (before, at and after it; in the first half and the second)."""
    seq_lens = [1, 15, 16, 17, 31, 32, 33, 70]
    run_case(attn, seq_lens, [1] * len(seq_lens), 8, 4, d, 32, dtype=dtype, seed=17)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_folded_in_pairs_give_the_bits_of_rows_folded_alone(attn, dtype):
    """GQA decodes (groups of 3 rows: a pair and one alone) and a prefill chunk with the per-row step's
    pairs on and off: the same arithmetic per row, so the same bits."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    if mod is None or mod.dev.set_pair_rows(True) < 0:
        pytest.skip("the AVX-512 attention step is not compiled here")
    kc, vc, tables, _ = random_paged([5, 40, 17, 33], 12, 4, 64, 16, num_blocks=96, seed=13)
    kc, vc = kc.to(dtype), vc.to(dtype)
    chunks = [1, 1, 6, 1]
    q = torch.randn(sum(chunks), 12, 64, generator=torch.Generator().manual_seed(14)).to(dtype)
    lens = torch.tensor([5, 40, 17, 33], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 8, 9], dtype=torch.int32)
    outs = {}
    try:
        for on in (True, False):
            mod.dev.set_pair_rows(on)
            outs[on] = attn(q, kc, vc, tables, lens, starts, 0.125)
    finally:
        mod.dev.set_pair_rows(True)
    assert torch.equal(outs[True], outs[False])


def test_prefetching_blocks_ahead_changes_no_bits(attn):
    """Decodes and a prefill chunk with no blocks prefetched, the default, and more blocks ahead than any
    sequence has: prefetches only ask for the cache's own blocks and leave the arithmetic as it is."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    if mod is None:
        pytest.skip("the C++ attention is not built here")
    kc, vc, tables, _ = random_paged([5, 40, 17, 33], 8, 4, 64, 16, num_blocks=96, seed=15)
    q = torch.randn(9, 8, 64, generator=torch.Generator().manual_seed(16)).bfloat16()
    lens = torch.tensor([5, 40, 17, 33], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 8, 9], dtype=torch.int32)
    default = mod.dev.set_prefetch_blocks(0)
    try:
        outs = []
        for ahead in (0, default, 8):
            mod.dev.set_prefetch_blocks(ahead)
            outs.append(attn(q, kc.bfloat16(), vc.bfloat16(), tables, lens, starts, 0.125))
    finally:
        mod.dev.set_prefetch_blocks(default)
    assert default == 1 and all(torch.equal(outs[0], o) for o in outs[1:])
    with pytest.raises(RuntimeError, match="at least 0"):
        mod.dev.set_prefetch_blocks(-1)


def test_bfloat16_within_rounding(attn):
    run_case(attn, [7, 30, 18], [1, 10, 18], 8, 4, 32, 16, dtype=torch.bfloat16, seed=7)


def test_inconsistent_inputs_raise(attn):
    kc = torch.zeros(4, 16, 2, 8)
    q = torch.zeros(1, 4, 8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="more blocks"):
        attn(q, kc, kc, table, torch.tensor([17], dtype=torch.int32), starts, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        attn(torch.zeros(1, 3, 8), kc, kc, table, torch.tensor([1], dtype=torch.int32), starts, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        attn(q, kc, kc, table.long(), torch.tensor([1], dtype=torch.int32), starts, 1.0)
