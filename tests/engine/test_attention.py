"""The engine's CPU decode path sorts decodes into length buckets; the result must not change."""

import torch

from quantkit.engine.attention import DECODE_BUCKET, _decode
from quantkit.kernels.paged_attention_reference import paged_decode_attention_reference


def test_bucketed_decode_equals_one_call_over_all_sequences():
    g = torch.Generator().manual_seed(0)
    num_seqs, heads, kv_heads, dim, block = 3 * DECODE_BUCKET + 5, 6, 2, 16, 16
    kc, vc = torch.randn(800, block, kv_heads, dim, generator=g), torch.randn(800, block, kv_heads, dim, generator=g)
    lens = torch.randint(1, 200, (num_seqs,), generator=g, dtype=torch.int32)
    width = -(-int(lens.max()) // block)
    tables = torch.randperm(800, generator=g)[: num_seqs * width].view(num_seqs, width).int()
    q = torch.randn(num_seqs, heads, dim, generator=g)
    expected = paged_decode_attention_reference(q, kc, vc, tables, lens, 0.25)
    torch.testing.assert_close(_decode(q, kc, vc, tables, lens, 0.25), expected)
