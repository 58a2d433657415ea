"""Eager attention a block of queries at a time (quantkit.model.chunked_attention) against transformers' own eager
attention for gpt-oss: the same outputs, with sinks and a sliding-window mask, whatever the block size."""

from __future__ import annotations

import pytest
import torch

from quantkit.model import chunked_attention


@pytest.mark.parametrize("block_rows", [1, 7, 100])
@pytest.mark.parametrize("window", [None, 24])
def test_query_blocks_give_transformers_eager_attention(block_rows, window, monkeypatch):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, n, d = 2, 8, 2, 100, 16
    module = type("Attn", (), {"num_key_value_groups": heads // kv_heads, "training": False})()
    module.sinks = torch.randn(heads, generator=g)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (heads, kv_heads, kv_heads))
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None].expand(b, 1, n, n)
    want, _ = eager_attention_forward(module, q, k, v, mask, d ** -0.5)
    monkeypatch.setattr(chunked_attention, "QUERY_BLOCK_BYTES", 4 * b * heads * n * block_rows)
    got, _ = chunked_attention.query_block_attention(module, q, k, v, mask, d ** -0.5, s_aux=module.sinks)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_loader_builds_gpt_oss_with_it(tiny_family):
    from quantkit.model.loader import build_skeleton
    from quantkit.model.source import open_model

    model = build_skeleton(open_model(tiny_family("gpt_oss")).hf_config, torch.float32)
    assert model.config._attn_implementation == chunked_attention.ATTENTION_NAME
    assert build_skeleton(open_model(tiny_family("mixtral")).hf_config, torch.float32).config._attn_implementation \
        != chunked_attention.ATTENTION_NAME
