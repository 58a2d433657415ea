"""The engine's CPU decode path sorts decodes into length buckets; the result must not change."""

import pytest
import torch

from quantkit.engine.attention import DECODE_BUCKET, _decode
from quantkit.kernels.paged_attention_reference import paged_decode_attention_reference

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)


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


def test_cpu_kernel_step_equals_the_torch_path(monkeypatch):
    """One step mixing decodes, a prefill after a prefix hit and a fresh prefill: the C++ kernel's
    metadata and the torch path's give the same attention (the torch path is the fallback when the
    extension does not build)."""
    from quantkit.engine import attention

    if not attention.use_cpu_kernel(torch.device("cpu"), torch.float32):
        pytest.skip("the C++ CPU attention kernel did not build here")
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 8, 4, 32, 16
    kc, vc = torch.randn(64, block, kv_heads, dim, generator=g), torch.randn(64, block, kv_heads, dim, generator=g)
    seq_lens, query_lens = [17, 50, 33, 9], [1, 18, 1, 9]
    blocks = torch.randperm(64, generator=g).tolist()
    block_ids = [[blocks.pop() for _ in range(-(-n // block))] for n in seq_lens]
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    args = (seq_lens, query_lens, block_ids, block, torch.device("cpu"))
    fast = attention.paged_attention(q, k, v, kc.clone(), vc.clone(), attention.build_metadata(*args), 0.2)
    monkeypatch.setattr(attention, "use_cpu_kernel", lambda device, dtype: False)
    meta = attention.build_metadata(*args)
    assert meta.seq_lens_t is None
    torch.testing.assert_close(fast, attention.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.2))
