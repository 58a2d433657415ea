"""The families of issue 39 through the engine: Phi-3 (fused q/k/v and gate/up in the checkpoint), Gemma 3 (scaled
embeddings, (1 + w) sandwich norms, q/k norms, a sliding-window layer with its own RoPE base, soft-capped logits),
Mixtral and Qwen3-MoE (top-k routing over experts), gpt-oss (experts stacked in the checkpoint with gate/up
interleaved, biases, clamped SwiGLU, attention sinks, YaRN; MXFP4 experts). Greedy tokens, token for token, against transformers' own fp32
forward: on the float checkpoint, and on 4-bit GPTQ / AWQ / compressed-tensors checkpoints, where transformers runs
the same weights dequantized (tests_support.dequantized) while the engine runs them on its int4 CPU kernel.

The prompts run past Gemma's 24-token window, and 16 of 32 share a 24-token prefix (prefix cache hits)."""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_FAMILIES
from engine.test_greedy_parity import engine_greedy, hf_greedy, make_prompts
from quantkit.engine import LLM, SamplingParams
from quantkit.model.quant_linear import QuantLinear
from tests_support.dequantized import dequantized_copy

ENGINE = dict(max_num_seqs=32, max_model_len=256, max_num_batched_tokens=64)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_float_greedy_matches_transformers(family, tiny_family):
    path = tiny_family(family)
    prompts = make_prompts(512, seed=1)
    got, stats = engine_greedy(path, prompts, **ENGINE)
    assert got == hf_greedy(path, prompts)
    assert stats.prefix_cache_hits > 0


QUANTIZED = [("phi3", "gptq", "gptq"), ("phi3", "awq", "awq"), ("gemma3", "gptq", "gptq"), ("gemma3", "awq", "awq"),
             ("mixtral", "gptq", "gptq"), ("mixtral", "awq", "awq"), ("qwen3_moe", "gptq", "gptq"),
             ("qwen3_moe", "awq", "awq"), ("qwen3_moe", "gptq", "compressed-tensors"),
             ("mixtral", "awq", "compressed-tensors"), ("gpt_oss", "gptq", "gptq"), ("gpt_oss", "awq", "awq"),
             ("gpt_oss", "gptq", "compressed-tensors")]


@pytest.mark.parametrize("family, method, layout", QUANTIZED, ids=["-".join(c) for c in QUANTIZED])
def test_quantized_greedy_matches_transformers_on_the_dequantized_weights(family, method, layout, quantized_family,
                                                                        tmp_path):
    qdir = quantized_family(family, method, layout)
    prompts = make_prompts(512, n=16, seed=2)
    llm = LLM(str(qdir), dtype="float32", cpu_int8_lm_head=False, cpu_int8_prefill=False,
              **ENGINE)  # the checkpoint's arithmetic: its float head, W4A16 prompts
    model = llm.engine.model
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(m.cpu_path.startswith("int4 (quantkit") for m in packed)
    # every projection 4-bit, q/k/v and each gate/up run as one: 2 for attention and 2 per MLP or expert a layer
    experts = model.shape.moe.num_experts if model.shape.moe else 1
    assert len(packed) == model.shape.num_layers * (2 + 2 * experts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    assert got == hf_greedy(dequantized_copy(qdir, tmp_path / "float"), prompts)


def test_moe_experts_run_4_bit_with_gate_and_up_fused(quantized_family):
    """Each expert's gate and up become one int4 linear at load (one kernel call per expert a step); the router
    stays float."""
    llm = LLM(str(quantized_family("qwen3_moe", "gptq", "gptq")), dtype="float32", max_model_len=128)
    block = llm.engine.model.model.layers[0].mlp
    assert not isinstance(block.gate, QuantLinear)
    assert len(block.experts) == 8
    for expert in block.experts:
        assert isinstance(expert.gate_up_proj, QuantLinear) and expert.gate_up_proj.out_features == 2 * 128
        assert isinstance(expert.down_proj, QuantLinear) and not hasattr(expert, "up_proj")


def test_the_sliding_window_changes_gemmas_outputs(tiny_family, monkeypatch):
    """The window binds on these prompts: the engine with every layer on full attention gives other tokens than
    transformers (so the parity above does test the window)."""
    import quantkit.engine.decoder_shape as decoder_shape

    path = tiny_family("gemma3")
    prompts = make_prompts(512, n=8, seed=1)
    want = hf_greedy(path, prompts)
    monkeypatch.setattr(decoder_shape, "layer_windows", lambda config: (None,) * config.num_hidden_layers)
    got, _ = engine_greedy(path, prompts, **ENGINE)
    assert got != want


@pytest.mark.parametrize("part", ["sinks", "yarn", "expert_bias", "act"])
def test_each_part_of_gpt_oss_changes_its_outputs(part, tiny_family):
    """The engine with one of gpt-oss's departures from Llama undone gives other tokens than transformers on these
    prompts (so the parity above tests each of them)."""
    path = tiny_family("gpt_oss")
    prompts = make_prompts(512, n=8, seed=1)
    llm = LLM(str(path), dtype="float32", **ENGINE)
    for layer in llm.engine.model.model.layers:
        attn = layer.self_attn
        if part == "sinks":
            attn.sinks = None
        elif part == "yarn":
            attn.scale = attn.s.head_dim ** -0.5
        for expert in layer.mlp.experts:
            if part == "expert_bias":
                expert.down_proj.bias = None
            elif part == "act":
                expert.act = "silu"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    assert got != hf_greedy(path, prompts, max_tokens=16)


def test_gpt_oss_with_mxfp4_experts_gives_its_float_twins_tokens(tiny_family, tmp_path):
    """gpt-oss as OpenAI ships it (MXFP4 experts): the engine dequantizes the experts at load and gives transformers'
    greedy tokens on the float twin (the same values stored in fp32)."""
    from tests_support.mxfp4 import mxfp4_twin

    mx, float_dir = mxfp4_twin(tiny_family("gpt_oss"), tmp_path)
    prompts = make_prompts(512, n=16, seed=1)
    got, _ = engine_greedy(mx, prompts, **ENGINE)
    assert got == hf_greedy(float_dir, prompts)


def test_gpt_oss_decodes_in_bf16(tiny_family):
    llm = LLM(str(tiny_family("gpt_oss")), dtype="bfloat16", max_model_len=128)
    out = llm.generate([[1, 5, 9, 33], [1, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_bf16_moe_decodes(quantized_family):
    """bf16 on a 4-bit MoE checkpoint: the experts' batches go through the bf16 kernels; outputs are tokens."""
    llm = LLM(str(quantized_family("mixtral", "gptq", "gptq")), dtype="bfloat16", max_model_len=128)
    out = llm.generate([[1, 5, 9, 33], [1, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_runs_its_experts_in_one_grouped_call(quantized_family, family, dtype, monkeypatch):
    """Each MoE layer's 4-bit experts are stacked at load, each expert's linears read views of the stack, and the
    grouped call (bf16 from AVX-512 BF16, fp32 everywhere) gives the per-expert loop's result bit for bit; where an
    expert gets as many rows as the kernels' dense crossover, the loop runs."""
    from quantkit.engine.decoder import ops_for
    from quantkit.engine.moe import MoEBlock
    from quantkit.kernels import moe_int4

    llm = LLM(str(quantized_family(family, "gptq", "gptq")), dtype=str(dtype).removeprefix("torch."),
              max_model_len=128)
    block = next(m for m in llm.engine.model.modules() if isinstance(m, MoEBlock))
    experts = getattr(block, block.spec.experts)
    grouped = block.grouped
    assert grouped is not None
    assert experts[3].gate_up_proj._cpu.packed.data_ptr() == grouped.w1[3].data_ptr()
    if not moe_int4.available(dtype):
        assert dtype not in grouped.max_m
        pytest.skip("the bf16 grouped experts op needs AVX-512 BF16 (not built at this CPU level)")
    max_m = grouped.max_m[dtype]
    x = torch.randn(6, llm.engine.model.shape.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    ops = ops_for(x)  # the elementwise ops the decoder hands the block (the fused C++ SiLU where built)
    with torch.no_grad():
        got = block(x, ops)
        block.grouped = None
        want = block(x, ops)
        block.grouped = grouped
    assert torch.equal(got, want)
    calls = []
    real = type(grouped).__call__
    monkeypatch.setattr(type(grouped), "__call__", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    spread = torch.randn(max_m, x.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        block(x, ops)
        got = block(spread, ops)  # a prefill whose tokens spread over the experts: each gets fewer than max_m rows
        block(torch.zeros(max_m, x.shape[1], dtype=dtype), ops)  # every token on the same k experts
        block.grouped = None
        want = block(spread, ops)
    assert calls == [6, max_m]
    assert torch.equal(got, want)
