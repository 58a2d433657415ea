"""The decoder's bound path (each layer's parts fetched once by `Decoder.bind`, no nn.Module dispatch per layer) gives
the logits of the module path bit for bit: float, bf16, q/k/v bias and 4-bit checkpoints; layers it cannot flatten
(per-head q/k norms) are left to the modules."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.decoder import DecoderLayer
from tests_support.int4_checkpoints import quantize_tiny

PROMPTS = [[1, 5, 9, 200, 31], [1] + list(range(3, 40)), [1, 7], [1] + list(range(50, 70))]


@pytest.fixture(scope="module")
def rtn_gptq_dir(tiny_llama, tmp_path_factory):
    return quantize_tiny(tiny_llama, tmp_path_factory, "rtn", "gptq", 64)


def outputs(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def modules_refused(*args, **kwargs):
    raise AssertionError("a bound step went through DecoderLayer.forward")


@pytest.mark.parametrize("model, dtype", [("tiny_llama", "float32"), ("tiny_llama", "bfloat16"),
                                          ("tiny_qwen2", "bfloat16"), ("rtn_gptq_dir", "bfloat16")])
def test_bound_path_gives_the_module_paths_logits(model, dtype, request, monkeypatch):
    # prefix caching off: the second run must compute what the first did, not read its cached blocks
    llm = LLM(str(request.getfixturevalue(model)), dtype=dtype, max_model_len=128, enable_prefix_caching=False)
    decoder = llm.engine.model
    assert decoder.bound_layers is not None and len(decoder.bound_layers) == len(decoder.model.layers)
    with monkeypatch.context() as m:
        m.setattr(DecoderLayer, "forward", modules_refused)
        bound = outputs(llm)
    decoder.bound_layers = None
    calls = []
    original = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert outputs(llm) == bound
    assert calls  # the second run did go through the modules


def test_layers_with_qk_norms_stay_on_the_modules(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32", max_model_len=128)
    decoder = llm.engine.model
    assert decoder.bound_layers is None and decoder.bind() is False
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bind_follows_replaced_modules(tiny_llama):
    """bind() again after a layer's projection is replaced: the bound path calls the new module."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128)
    decoder = llm.engine.model
    layer = decoder.model.layers[0]
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(x.shape[0])
            return self.inner(x)

    layer.mlp.down_proj = Spy(layer.mlp.down_proj)
    assert decoder.bind()
    llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert seen == [3, 1, 1]  # the prompt, then one row a decode step
