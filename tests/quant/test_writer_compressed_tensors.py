"""`quantize --format compressed-tensors`: any method into the pack-quantized layout, read back by
quantkit and by the compressed-tensors library, equal to the same run written as GPTQ / AWQ."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.format.packing import dequantize
from quantkit.model.loader import load_model
from quantkit.model.quant_linear import QuantLinear
from tests_support.cli import run_cli, synthetic_calib

pytestmark = pytest.mark.slow


def quantize(model, out, *extra, calib):
    code, output = run_cli("quantize", model, "--out", out, "--calib", calib, "--nsamples", "8", "--seqlen", "64",
                           *extra)
    assert code == 0, output


def dense_weights(path) -> dict[str, torch.Tensor]:
    model, _ = load_model(path)
    return {n: dequantize(m.packed()) for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("method,other,extra", [
    ("rtn", "gptq", ("--bits", "8", "--group-size", "-1")),
    # compressed-tensors stores act-order with static groups (actorder "weight"): the GPTQ run matches it
    ("gptq", "gptq", ("--no-sym", "--desc-act", "--static-groups", "--group-size", "32")),
    ("awq", "awq", ("--group-size", "64")),
])
def test_same_run_in_two_formats_holds_the_same_weights(tiny_llama, tmp_path, method, other, extra):
    calib = synthetic_calib(tmp_path / "c.txt")
    quantize(tiny_llama, tmp_path / "ct", "--method", method, "--format", "compressed-tensors", *extra, calib=calib)
    quantize(tiny_llama, tmp_path / "ref", "--method", method, "--format", other, *extra, calib=calib)
    ours, ref = dense_weights(tmp_path / "ct"), dense_weights(tmp_path / "ref")
    assert set(ours) == set(ref) and ours
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=0, msg=name)
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == ("weight" if "--desc-act" in extra else None)
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in tensors
    assert not any(k.endswith((".qweight", ".qzeros", ".weight_g_idx")) for k in tensors)


@pytest.mark.parametrize("extra", [("--method", "rtn", "--no-sym", "--group-size", "64"),
                                   ("--method", "gptq", "--desc-act", "--group-size", "32")])
def test_library_reads_our_checkpoint(tiny_llama, tmp_path, extra):
    """compressed-tensors' own config model and compressor decompress what quantkit wrote (act-order included:
    written as the library's actorder "weight", which needs no g_idx)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    pytest.importorskip("compressed_tensors")
    out = tmp_path / "ct"
    quantize(tiny_llama, out, "--format", "compressed-tensors", *extra, calib=synthetic_calib(tmp_path / "c.txt"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    tensors = load_file(str(out / "model.safetensors"))
    for name, w in dense_weights(out).items():
        module = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == name}
        theirs = PackedQuantizationCompressor.decompress(module, scheme)["weight"]
        torch.testing.assert_close(theirs, w.half(), rtol=0, atol=0, msg=name)


def test_check_original_on_awq_into_compressed_tensors(tiny_llama, tmp_path):
    """The AWQ plan saved beside the weights is folded into the original, whatever the format."""
    out = tmp_path / "ct"
    calib = synthetic_calib(tmp_path / "c.txt")
    quantize(tiny_llama, out, "--method", "awq", "--format", "compressed-tensors", "--group-size", "64", calib=calib)
    code, output = run_cli("check", out, "--original", tiny_llama, "--nsamples", "2", "--seqlen", "32")
    assert code == 0, output
