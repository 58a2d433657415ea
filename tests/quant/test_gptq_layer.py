"""GPTQ over a decoder layer with asymmetric calibration (GPTAQ, --gptaq): the float stream beside the quantized one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.config import CalibConfig, QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.quant import gptq_layer, pipeline
from tests_support.cli import run_cli, synthetic_calib


def quantize(model, tmp_path, name, **kw):
    out = tmp_path / name
    out.mkdir()
    calib = tmp_path / "calib.txt"
    if not calib.exists():
        synthetic_calib(calib)
    cfg = QuantizeConfig(model=str(model), out=out, method="gptq", group_size=32, device="cpu",
                         calib=CalibConfig(source=str(calib), nsamples=4, seqlen=64), **kw)
    pipeline.quantize_model(cfg, out_dir=out, show_progress=False)
    return load_file(out / "model.safetensors"), json.loads((out / "quantkit_meta.json").read_text())


def layer_tensors(tensors: dict, index: int) -> dict:
    prefix = f"model.layers.{index}."
    return {k: v for k, v in tensors.items() if k.startswith(prefix) and k.endswith((".qweight", ".scales"))}


@pytest.mark.parametrize("true_sequential", [False, True])
def test_gptaq_changes_nothing_where_both_models_see_the_same_inputs(tiny_llama, tmp_path, true_sequential):
    """Where a linear reads the same inputs in the float and the quantized model, D = 0 and GPTAQ's codes are GPTQ's
    to the bit: layer 0's q/k/v always; without true-sequential every linear of layer 0 (its Hessians all come from
    one float run of the layer). Past them the quantized model's inputs have drifted (from layer 1 on; within layer 0
    under true-sequential, o_proj reads the quantized q/k/v's attention) and GPTAQ solves for the float model's
    outputs instead."""
    plain, _ = quantize(tiny_llama, tmp_path, "gptq", true_sequential=true_sequential)
    asym, meta = quantize(tiny_llama, tmp_path, "gptaq", gptaq=True, gptaq_alpha=1.0, true_sequential=true_sequential)
    first = layer_tensors(plain, 0)
    same = {k: v for k, v in first.items() if ".self_attn.o_proj." not in k and ".mlp." not in k} \
        if true_sequential else first
    assert same and all(torch.equal(v, asym[k]) for k, v in same.items())
    drifted = {k: v for k, v in first.items() if k not in same} | layer_tensors(plain, 1)
    assert any(not torch.equal(v, asym[k]) for k, v in drifted.items() if k.endswith(".qweight"))
    if true_sequential:
        assert not torch.equal(first["model.layers.0.self_attn.o_proj.qweight"],
                               asym["model.layers.0.self_attn.o_proj.qweight"])
    assert meta["config"]["gptaq"] is True and meta["config"]["gptaq_alpha"] == 1.0


def test_the_shipped_gptaq_recipe_plans_gptaq(tiny_llama):
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", "gptaq-w4g128", "--group-size", "32",
                           "--dry-run")
    assert code == 0 and "GPTAQ (alpha 0.25, true-sequential)" in output, output


def test_gptaq_is_true_sequential_unless_told_otherwise(tmp_path):
    def ts(**kw):
        return QuantizeConfig(model="m", out=tmp_path / "o", **kw).true_sequential

    assert (ts(), ts(gptaq=True), ts(gptaq=True, true_sequential=False), ts(true_sequential=True)) == \
        (False, True, False, True)


def test_the_float_stream_is_the_float_models_hidden_states(tiny_llama, tmp_path, monkeypatch):
    """What GPTAQ reads as the float model's inputs to layer i is the float model's hidden_states[i] on the same
    calibration windows (fp32 passes), and the quantized stream drifts from it past layer 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration.data import load_calibration

    seen = {}
    quantize_layer = gptq_layer.GPTQMethod.quantize_layer

    def spy(self, ctx):
        seen[ctx.index] = (torch.cat(ctx.float_inputs), torch.cat(ctx.inputs))
        return quantize_layer(self, ctx)

    monkeypatch.setattr(gptq_layer.GPTQMethod, "quantize_layer", spy)
    quantize(tiny_llama, tmp_path, "gptaq", gptaq=True, compute_dtype="float32", true_sequential=False)
    ids = load_calibration(str(tmp_path / "calib.txt"), AutoTokenizer.from_pretrained(str(tiny_llama)), 4, 64,
                           0).input_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert sorted(seen) == list(range(model.config.num_hidden_layers))
    for i, (float_in, quant_in) in seen.items():
        torch.testing.assert_close(float_in, hidden[i], rtol=1e-4, atol=1e-4)
        if i > 0:
            assert not torch.allclose(quant_in, hidden[i], rtol=1e-4, atol=1e-4)


def test_the_float_twin_holds_its_linears_in_the_compute_dtype_and_runs_as_the_fp32_layer(tiny_llama, tmp_path,
                                                                                        monkeypatch):
    """Under bf16 autocast the twin's linears are stored in bf16 (half the copy) and its outputs are the fp32 layer's
    copy's to the bit (autocast casts those weights to bf16 in every pass anyway); its norms stay fp32."""
    import copy
    from dataclasses import replace

    checked = []
    make_twin = gptq_layer._float_twin

    def spy(ctx):
        twin = make_twin(ctx)
        reference = replace(ctx, layer=copy.deepcopy(ctx.layer), inputs=ctx.float_inputs, float_inputs=None)
        dtypes = {p.dtype for m in twin.layer.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
        norms = {p.dtype for name, p in twin.layer.named_parameters() if "norm" in name}
        same = all(torch.equal(a, b) for a, b in zip(twin.run_layer(), reference.run_layer(), strict=True))
        checked.append((dtypes, norms, same))
        return twin

    monkeypatch.setattr(gptq_layer, "_float_twin", spy)
    quantize(tiny_llama, tmp_path, "gptaq", gptaq=True, compute_dtype="bfloat16")
    assert checked and all(c == ({torch.bfloat16}, {torch.float32}, True) for c in checked)


def test_plain_gptq_carries_no_float_stream(tiny_llama, tmp_path, monkeypatch):
    streams = []
    quantize_layer = gptq_layer.GPTQMethod.quantize_layer

    def spy(self, ctx):
        streams.append(ctx.float_inputs)
        return quantize_layer(self, ctx)

    monkeypatch.setattr(gptq_layer.GPTQMethod, "quantize_layer", spy)
    quantize(tiny_llama, tmp_path, "gptq")
    assert streams and all(s is None for s in streams)


@pytest.mark.parametrize("kw,message", [({"method": "awq", "gptaq": True}, "--gptaq applies to --method gptq"),
                                         ({"gptaq": True, "gptaq_alpha": 0.0}, "--gptaq-alpha must be in (0, 1]"),
                                         ({"gptaq": True, "gptaq_alpha": 1.5}, "--gptaq-alpha must be in (0, 1]"),
                                         ({"gptaq_alpha": 1.0}, "--gptaq-alpha applies with --gptaq only")])
def test_bad_gptaq_settings_are_refused(tmp_path, kw, message):
    with pytest.raises(QuantkitError, match=message.replace("(", r"\(").replace("]", r"\]")):
        QuantizeConfig(model="m", out=tmp_path / "o", **kw)


def test_gptaq_on_a_mixture_of_experts_is_one_clear_error(tiny_family, tmp_path):
    out = tmp_path / "q"
    code, output = run_cli("quantize", tiny_family("mixtral"), "--out", out, "--gptaq", "--nsamples", "4",
                           "--seqlen", "32", "--calib", synthetic_calib(tmp_path / "calib.txt"))
    assert code != 0 and "--gptaq" in output and "mixture of experts" in output and "Traceback" not in output
    assert not out.exists()
