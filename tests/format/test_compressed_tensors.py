"""The pack-quantized layout against the compressed-tensors library itself (its compressor and config)."""

import pytest
import torch

from quantkit.format import compressed_tensors as ct
from quantkit.format.packing import dequantize
from quantkit.format.primitives import QuantScheme, QuantizedWeight, rtn_quantize

compressed_tensors = pytest.importorskip("compressed_tensors")

CASES = [(4, 128, True), (4, 64, False), (4, 32, True), (4, -1, False), (8, 128, True), (8, -1, True), (8, 32, False)]


def _scheme(qc: dict):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(qc).config_groups["group_0"]


def _weight(bits, group_size, sym, act_order=False) -> QuantizedWeight:
    torch.manual_seed(bits * 1000 + group_size)
    qw = rtn_quantize(torch.randn(64, 256), QuantScheme(bits, group_size, sym))
    if act_order:  # a non-monotonic g_idx, as GPTQ's act-order leaves it
        qw.g_idx = qw.g_idx[torch.randperm(256)].contiguous()
    return qw


@pytest.mark.parametrize("bits,group_size,sym", CASES)
def test_library_decompresses_ours_to_our_weight(bits, group_size, sym):
    from compressed_tensors.compressors import PackedQuantizationCompressor

    qw = _weight(bits, group_size, sym)
    tensors = {k.rpartition(".")[2]: v for k, v in ct.ct_tensors(qw, "m").items()}
    qc = ct.quantization_config(bits, group_size, sym, None, ["lm_head"])
    out = PackedQuantizationCompressor.decompress(dict(tensors), _scheme(qc))
    # the library multiplies in the scale's dtype (fp16): one rounding of the exact product
    torch.testing.assert_close(out["weight"], qw.dequantize().half(), rtol=0, atol=0)
    # and our reader turns the same tensors into a PackedLinear with the same weight
    torch.testing.assert_close(dequantize(ct.ct_to_packed(tensors, bits, group_size, sym)), qw.dequantize(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bits,group_size,sym", CASES)
def test_library_compresses_to_our_bits(bits, group_size, sym):
    """The library's own compress of the dequantized weight, with our scales and zero points, gives our words."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    qw = _weight(bits, group_size, sym)
    ours = {k.rpartition(".")[2]: v for k, v in ct.ct_tensors(qw, "m").items()}
    state = {"weight": qw.dequantize(), "weight_scale": qw.scales.T.contiguous().half(),
             "weight_zero_point": (qw.zeros.T - 2 ** (bits - 1)).to(torch.int8).contiguous()}
    qc = ct.quantization_config(bits, group_size, sym, None, [])
    theirs = PackedQuantizationCompressor.compress(state, _scheme(qc))
    assert torch.equal(theirs["weight_packed"], ours["weight_packed"])
    assert torch.equal(theirs["weight_shape"], ours["weight_shape"])
    if not sym:
        assert torch.equal(theirs["weight_zero_point"], ours["weight_zero_point"])


def test_act_order_g_idx_round_trips():
    qw = _weight(4, 32, False, act_order=True)
    tensors = {k.rpartition(".")[2]: v for k, v in ct.ct_tensors(qw, "m").items()}
    assert torch.equal(tensors["weight_g_idx"], qw.g_idx)
    torch.testing.assert_close(dequantize(ct.ct_to_packed(tensors, 4, 32, False)), qw.dequantize(), rtol=0, atol=0)


def test_config_validates_in_the_library_and_parses_back():
    # what we write (actorder None or "weight") validates in the library; "group" (a stored g_idx), which
    # compressed-tensors 0.20 removed and 0.17 (vLLM 0.32's) still reads, parses back as a g_idx checkpoint
    for actorder in (None, "weight"):
        qc = ct.quantization_config(4, 128, False, actorder, ["lm_head"])
        scheme = _scheme(qc)
        assert (scheme.weights.num_bits, scheme.weights.group_size, scheme.weights.symmetric) == (4, 128, False)
        assert scheme.weights.actorder == actorder
        groups, ignore = ct.parse_quantization_config(qc)
        assert groups == (ct.CTGroup(("Linear",), 4, 128, False, False),) and ignore == ("lm_head",)
    for actorder in ("group", "dynamic"):
        assert ct.parse_quantization_config(ct.quantization_config(4, 128, True, actorder, []))[0][0].act_order


@pytest.mark.parametrize("change,message", [
    (lambda g: g.update(input_activations={"num_bits": 8, "type": "int"}), "activation quantization"),
    (lambda g: g["weights"].update(type="float", num_bits=8), "float weights"),
    (lambda g: g.update(format="float-quantized"), "format 'float-quantized'"),
    (lambda g: g["weights"].update(num_bits=2), "2-bit"),
    (lambda g: g["weights"].update(strategy="tensor"), "strategy 'tensor'"),
])
def test_schemes_we_do_not_run_are_named(change, message):
    qc = ct.quantization_config(4, 128, True, None, [])
    change(qc["config_groups"]["group_0"])
    with pytest.raises(ValueError, match=message):
        ct.parse_quantization_config(qc)


def test_shapes_that_disagree_with_the_config_are_named():
    tensors = {k.rpartition(".")[2]: v for k, v in ct.ct_tensors(_weight(4, 64, True), "m").items()}
    with pytest.raises(ValueError, match="weight_scale"):
        ct.ct_to_packed(tensors, 4, 128, True)
    with pytest.raises(ValueError, match="weight_packed"):
        ct.ct_to_packed(tensors, 8, 64, True)
    with pytest.raises(ValueError, match="weight_zero_point"):
        ct.ct_to_packed(tensors, 4, 64, False)


def test_target_matching():
    groups = (ct.CTGroup(("Linear",), 4, 128, True, False), ct.CTGroup(("re:.*down_proj$",), 8, -1, True, False))
    assert ct.group_for(groups, "model.layers.0.mlp.down_proj").bits == 8
    assert ct.group_for(groups, "model.layers.0.mlp.up_proj").bits == 4


def test_fp32_scales_are_kept_as_stored():
    """llm-compressor stores scales in the model's dtype: an fp32 model's scales must not round to fp16."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    qw = _weight(4, 64, False)
    tensors = {k.rpartition(".")[2]: v for k, v in ct.ct_tensors(qw, "m").items()}
    tensors["weight_scale"] = tensors["weight_scale"].float() * (1 + 1e-6)  # not representable in fp16
    p = ct.ct_to_packed(tensors, 4, 64, False)
    assert p.scales.dtype == torch.float32
    theirs = PackedQuantizationCompressor.decompress(dict(tensors), _scheme(ct.quantization_config(4, 64, False, None, [])))
    torch.testing.assert_close(dequantize(p), theirs["weight"], rtol=1e-6, atol=0)
