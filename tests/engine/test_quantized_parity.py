"""Quantized checkpoints made by `quantize_model` (GPTQ; and RTN written in the AWQ GEMM layout), run by
the engine, against the same checkpoint loaded through QuantLinear in transformers
(quantkit.model.loader) and its `generate`."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams

MAX_TOKENS = 16


def quantize_tiny(model, tmp_path_factory, method: str, fmt: str, group_size: int):
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    tmp = tmp_path_factory.mktemp(f"{method}-{fmt}")
    calib = tmp / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(64, seed=1)))
    out = tmp / "ckpt"
    out.mkdir()
    cfg = QuantizeConfig(model=str(model), out=out, method=method, format=fmt, bits=4, group_size=group_size,
                         calib=CalibConfig(source=str(calib), nsamples=8, seqlen=64), device="cpu")
    quantize_model(cfg, out_dir=out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def gptq_dir(tiny_llama, tmp_path_factory):
    return quantize_tiny(tiny_llama, tmp_path_factory, "gptq", "gptq", 64)


@pytest.fixture(scope="module")
def awq_layout_dir(tiny_qwen2, tmp_path_factory):
    return quantize_tiny(tiny_qwen2, tmp_path_factory, "rtn", "awq", 32)


@pytest.mark.slow
def test_gptq_checkpoint_greedy_matches_quantlinear_in_transformers(gptq_dir):
    assert_engine_matches_quantlinear(gptq_dir, "gptq")


@pytest.mark.slow
def test_awq_layout_checkpoint_greedy_matches_quantlinear_in_transformers(awq_layout_dir):
    assert_engine_matches_quantlinear(awq_layout_dir, "awq")


def assert_engine_matches_quantlinear(gptq_dir, layout: str) -> None:
    from quantkit.model.loader import load_model
    from quantkit.engine.weights import WeightMemory
    from quantkit.model.quant_linear import QuantLinear

    hf, info = load_model(gptq_dir, torch.float32)
    assert info is not None and info.layout == layout
    assert any(isinstance(m, QuantLinear) for m in hf.modules())
    g = torch.Generator().manual_seed(2)
    prompts = [[1] + torch.randint(3, 512, (1 + (13 * i) % 50,), generator=g).tolist() for i in range(32)]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False)[0, len(p):].tolist())
    llm = LLM(str(gptq_dir), dtype="float32", max_model_len=256, max_num_seqs=32, max_num_batched_tokens=128)
    assert llm.engine.quant_info.layout == layout
    # q/k/v and gate/up each fused into one kernel call: 4 quantized linears in each of the 2 layers
    assert all(isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
               for layer in llm.engine.model.model.layers)
    assert sum(isinstance(m, QuantLinear) for m in llm.engine.model.modules()) == 2 * 4
    memory = WeightMemory.of(llm.engine.model)  # repacked for a CPU int4 kernel, checkpoint tensors dropped
    assert sum(n for path, n in memory.paths.items() if path.startswith("int4")) == 2 * 4 and memory.resident < memory.bf16_equivalent * 2  # fp32 float parts
    assert all(m.qweight is None for m in llm.engine.model.modules() if isinstance(m, QuantLinear))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    assert got == want
