"""Loading checkpoints: quant-config parsing, QuantLinear, and clear errors."""

import json
import shutil

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader, resolve_model_path
from quantkit.model.loader import load_model, read_quant_info
from quantkit.model.quant_linear import QuantLinear
from quantkit.format.packing import dequantize, pack
from quantkit.format.primitives import QuantScheme, rtn_quantize


def test_read_quant_info_gptq_awq_and_unknown():
    gptq = read_quant_info({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                    "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"}})
    assert (gptq.layout, gptq.desc_act, gptq.sym) == ("gptq_v2", True, False)
    awq = read_quant_info({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                   "zero_point": True, "version": "gemm"}})
    assert (awq.layout, awq.group_size) == ("awq", 64)
    assert read_quant_info({}) is None
    with pytest.raises(QuantkitError, match="unsupported quant_method"):
        read_quant_info({"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(QuantkitError, match="GEMM"):
        read_quant_info({"quantization_config": {"quant_method": "awq", "version": "gemv"}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_dense_dequantized(dtype):
    qw = rtn_quantize(torch.randn(32, 64), QuantScheme(4, 32, True))
    p = pack(qw, "gptq")
    p.bias = torch.randn(32)
    layer = QuantLinear(p)
    x = torch.randn(3, 5, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x.float(), dequantize(p), p.bias).to(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(layer(x), expected, **tol)
    assert layer(x).shape == (3, 5, 32) and layer.in_features == 64 and layer.out_features == 32
    assert layer.cpu_path.startswith("int4") and layer.qweight is not None  # lazily repacked: the checker reads them


def test_quant_linear_repack_for_cpu_drops_the_checkpoint_tensors_and_keeps_no_dense_copy():
    p = pack(rtn_quantize(torch.randn(64, 256), QuantScheme(4, 128, True)), "gptq")
    layer = QuantLinear(p)
    x = torch.randn(4, 256)
    want = torch.nn.functional.linear(x, dequantize(p))
    assert layer.repack_for_cpu(torch.float32).startswith("int4")
    assert layer.qweight is None and layer.scales is None
    assert layer.weight_bytes() < 0.3 * 64 * 256 * 2  # vs the bf16 dense weight
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # compiles the C++ kernel where it is not cached
def test_quant_linear_runs_4_bit_on_quantkits_kernel_where_it_builds():
    from quantkit.kernels import int4_cpu

    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    p = pack(rtn_quantize(torch.randn(32, 128), QuantScheme(4, 16, False)), "gptq")  # a group torch's kernel refuses
    layer = QuantLinear(p)
    assert layer.repack_for_cpu(torch.float32) == "int4 (quantkit AVX2 kernel)"
    x = torch.randn(2, 128)
    got = layer(x)  # 2 rows: x in 16-bit fixed point per group (kernels/csrc/int4_x16_avx2.h)
    torch.testing.assert_close(got, int4_cpu.int4_linear_reference(x, layer._cpu, layer.bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, dequantize(p)), rtol=1e-3, atol=1e-3)


def test_quant_linear_says_why_it_falls_back_to_torchs_int4_kernel(monkeypatch):
    from quantkit.kernels import int4_cpu

    monkeypatch.setattr(int4_cpu, "unavailable", lambda: "no C++ compiler (c++) on PATH")
    p = pack(rtn_quantize(torch.randn(32, 128), QuantScheme(4, 32, True)), "gptq")
    layer = QuantLinear(p)
    assert layer.repack_for_cpu(torch.float32) == "int4 (torch int4pack; quantkit kernel: no C++ compiler (c++) on PATH)"
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dequantize(p)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "group_size", "why"), [(4, 16, "group size 16"), (8, 64, "per-channel")])
def test_quant_linear_falls_back_to_dense_and_says_why(bits, group_size, why, monkeypatch):
    from quantkit.kernels import int4_cpu

    monkeypatch.setattr(int4_cpu, "unavailable", lambda: "no C++ compiler (c++) on PATH")
    p = pack(rtn_quantize(torch.randn(32, 128), QuantScheme(bits, group_size, True)), "gptq")
    layer = QuantLinear(p)
    path = layer.repack_for_cpu(torch.float32)
    assert path.startswith("dense") and why in path
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dequantize(p)), rtol=1e-5, atol=1e-5)


def test_float_checkpoint_loads_like_transformers(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    ours, info = load_model(tiny_qwen2)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 12))
    with torch.no_grad():
        assert info is None and torch.equal(ours(ids).logits, ref(ids).logits)


def test_packed_tensors_without_quant_config_is_an_error(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(str(model / "model.safetensors"))
    w = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    tensors.update(pack(rtn_quantize(w, QuantScheme(4, 128, True)), "gptq").tensors("model.layers.0.self_attn.q_proj"))
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(QuantkitError, match="no quantization_config"):
        load_model(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    (model / "config.json").write_text(json.dumps(cfg))
    loaded, info = load_model(model)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, QuantLinear)
    assert not isinstance(loaded.model.layers[0].self_attn.k_proj, QuantLinear)


def test_reader_and_resolver_errors(tmp_path):
    with pytest.raises(QuantkitError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(QuantkitError, match="only PyTorch .bin"):
        ShardReader(tmp_path)


def test_hub_id_is_downloaded_when_online(tiny_llama, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None):
        calls.append((repo_id, tuple(allow_patterns)))
        return str(tiny_llama)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("org/tiny") == tiny_llama
    assert calls[0][0] == "org/tiny" and "*.safetensors" in calls[0][1]
