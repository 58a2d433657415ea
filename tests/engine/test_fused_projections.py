"""q/k/v and gate/up fused into one linear at load (oneDNN prepacked in fp32, quantkit's bf16 kernel in bf16 where the
CPU has AVX-512 BF16): the decoder computes the same logits as with the separate linears, bit for bit, so greedy
outputs and logprobs do not move."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine import weights
from quantkit.kernels.bf16_cpu import Bf16DotLinear
from quantkit.kernels.cpu_linear import PrepackedLinear, prepack_supported

pytestmark = [pytest.mark.skipif(not prepack_supported(torch.float32), reason="this torch has no oneDNN"),
              pytest.mark.usefixtures("cpu_level")]  # at each CPU level this machine runs (conftest.py)


def generate(path, dtype: str = "float32") -> tuple[LLM, list]:
    llm = LLM(str(path), dtype=dtype, max_model_len=128)
    prompts = [[1, 5, 9, 200, 31], [1] + list(range(3, 40)), [1, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    return llm, [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])  # plain, q/k/v bias, q/k norm
def test_fused_projections_change_no_output(model, request, monkeypatch):
    path = request.getfixturevalue(model)
    fused_llm, fused = generate(path)
    layer = fused_llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PrepackedLinear) and not hasattr(layer.self_attn, "q_proj")
    assert isinstance(layer.mlp.gate_up_proj, PrepackedLinear) and not hasattr(layer.mlp, "up_proj")
    monkeypatch.setattr(weights, "fuse_float_projections", lambda model, concat: 0)
    separate_llm, separate = generate(path)
    assert separate_llm.engine.model.model.layers[0].self_attn.qkv_proj is None
    assert fused == separate


@pytest.mark.usefixtures("needs_bf16_dot")
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])  # plain, q/k/v bias
def test_bf16_model_runs_the_bf16_kernel_fused_or_not_alike(model, request, monkeypatch):
    path = request.getfixturevalue(model)
    fused_llm, fused = generate(path, "bfloat16")
    layer = fused_llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Bf16DotLinear) and isinstance(layer.mlp.gate_up_proj, Bf16DotLinear)
    assert isinstance(layer.self_attn.o_proj, Bf16DotLinear)
    monkeypatch.setattr(weights, "fuse_float_projections", lambda model, concat: 0)
    separate_llm, separate = generate(path, "bfloat16")
    assert isinstance(separate_llm.engine.model.model.layers[0].self_attn.q_proj, Bf16DotLinear)
    assert fused == separate
