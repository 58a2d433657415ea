"""The engine's MoE block against a per-token torch reference: each token's top-k experts' outputs, weighted, added
in ascending expert order in the block's dtype (transformers' order), in decode (1 token) and prefill shapes (tokens
sharing experts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.engine.moe import MoEBlock
from quantkit.format.arch import ExpertsSpec, MoEShape

SPEC = ExpertsSpec(block="mlp", hf_attr="mlp", gate="gate_proj", up="up_proj", down="down_proj")


@dataclasses.dataclass
class Shape:  # the DecoderShape fields MoEBlock reads
    hidden_size: int = 64
    act: str = "silu"
    experts: ExpertsSpec = SPEC
    moe: MoEShape = MoEShape(num_experts=8, top_k=3, intermediate=32, renormalize=True)
    swiglu: tuple[float, float] = (1.702, 7.0)  # gpt-oss's activation only


def reference(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H], token by token."""
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, chosen = torch.topk(probs[t], block.moe.top_k)
        w = w / w.sum()
        for e in sorted(chosen.tolist()):
            ex = block.experts[e]
            y = ex.down_proj(torch.nn.functional.silu(ex.gate_proj(x[t:t + 1])) * ex.up_proj(x[t:t + 1]))
            out[t] += (y[0] * w[chosen.tolist().index(e)]).to(out.dtype)
    return out


@pytest.mark.parametrize("tokens", [1, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_is_the_per_token_sum_in_ascending_expert_order(tokens, dtype):
    torch.manual_seed(tokens)
    block = MoEBlock(Shape()).to(dtype)
    x = torch.randn(tokens, 64, dtype=dtype)
    with torch.no_grad():
        got, want = block(x), reference(block, x)
    if tokens > 8:  # prefill: experts shared by several tokens (40 x 3 choices over 8 experts)
        _, chosen = torch.topk(block.gate(x).float(), 3)
        assert torch.bincount(chosen.reshape(-1), minlength=8).max() > 1
    torch.testing.assert_close(got, want)  # an expert batch runs as one matmul: its rounding, not per token
