"""Every common layout (AutoGPTQ v1, GPTQModel v2 with dynamic rules, AutoAWQ GEMM, compressed-tensors
pack-quantized) read through load_model and the engine's loader, built from each spec in tests_support.layouts."""

import json

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.packing import dequantize
from quantkit.model.loader import load_model
from quantkit.model.quant_format import read_quant_info
from quantkit.model.quant_linear import QuantLinear
from tests_support.layouts import Layout, ct_config, write_layout

LAYOUTS = {
    "autogptq-v1-g128": Layout("gptq_v1", 4, 128, True),
    "autogptq-v1-legacy-config": Layout("gptq_v1_legacy", 4, 64, True),
    "autogptq-v1-asym-actorder-g32": Layout("gptq_v1", 4, 32, False, act_order=True),
    "gptqmodel-v2-asym-dynamic": Layout("gptq_v2", 4, 64, False, dynamic={
        r"+:.*mlp\.down_proj": {"bits": 8, "group_size": 32}, r"-:model\.layers\.1\.self_attn\.o_proj": {}}),
    "gptqmodel-v2-8bit-per-channel": Layout("gptq_v2", 8, -1, True),
    "autoawq-gemm-g64": Layout("awq", 4, 64, False),
    "ct-w4a16-g128": Layout("ct", 4, 128, True),
    "ct-w4a16-asym-g32": Layout("ct", 4, 32, False),
    "ct-w4a16-actorder-g64": Layout("ct", 4, 64, True, act_order=True),
    "ct-w4a16-asym-actorder-g64": Layout("ct", 4, 64, False, act_order=True),
    "ct-w8a16-channel": Layout("ct", 8, -1, True),
    "ct-w8a16-g128": Layout("ct", 8, 128, True),
}


@pytest.fixture(scope="module")
def layouts(tiny_llama, tmp_path_factory):
    if any(layout.kind == "ct" for layout in LAYOUTS.values()):
        pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("layouts")
    return {name: (root / name, write_layout(tiny_llama, root / name, layout)) for name, layout in LAYOUTS.items()}


def _quant_linears(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_loads_to_its_dequantized_weights(name, layouts, tiny_llama):
    from transformers import AutoModelForCausalLM

    path, expected = layouts[name]
    model, info = load_model(path)
    linears = _quant_linears(model)
    assert set(linears) == set(expected)
    for n, m in linears.items():
        torch.testing.assert_close(dequantize(m.packed()), expected[n], rtol=0, atol=0, msg=n)
    # the whole model: logits equal a float model holding the same dequantized weights
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.no_grad():
        for n, w in expected.items():
            ref.get_submodule(n).weight.copy_(w)
        ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_dynamic_rules_give_per_module_schemes(layouts):
    path, expected = layouts["gptqmodel-v2-asym-dynamic"]
    model, info = load_model(path)
    linears = _quant_linears(model)
    assert "model.layers.1.self_attn.o_proj" not in linears and "model.layers.0.self_attn.o_proj" in linears
    down, up = linears["model.layers.0.mlp.down_proj"], linears["model.layers.0.mlp.up_proj"]
    assert (down.bits, down.group_size, up.bits, up.group_size) == (8, 32, 4, 64)


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # by the engine's load


@pytest.mark.parametrize("name", ["autogptq-v1-asym-actorder-g32", "autoawq-gemm-g64", "ct-w4a16-asym-actorder-g64",
                                  "ct-w8a16-channel"])
def test_engine_reads_the_layout(name, layouts):
    from quantkit.engine.weights import load_decoder
    from quantkit.model.source import open_model

    path, expected = layouts[name]
    decoder, info = load_decoder(open_model(path), torch.float32, torch.device("cpu"))
    linears = _quant_linears(decoder)
    parts = {n: [f"{n.rpartition('.')[0]}.{p}" for p in FUSED.get(n.rpartition(".")[2], ())] or [n] for n in linears}
    assert sorted(p for names in parts.values() for p in names) == sorted(expected)
    expected = {n: torch.cat([expected[p] for p in names]) for n, names in parts.items()}  # fused: side by side
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n, m in linears.items():  # repacked for the CPU kernels: outputs, not tensors, are compared
            xs = x[:, :m.in_features].contiguous()
            ref = xs @ expected[n].T
            torch.testing.assert_close(m(xs), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()), msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["autogptq-v1-asym-actorder-g32", "gptqmodel-v2-asym-dynamic", "ct-w4a16-asym-g32",
                                  "ct-w8a16-g128"])
def test_check_original_on_peer_layouts(name, layouts, tiny_llama):
    from quantkit.check.checkpoint import check_checkpoint

    path, _ = layouts[name]
    report = check_checkpoint(path, original=tiny_llama, max_rel_error=0.5, nsamples=2, seqlen=32,
                              show_progress=False)
    assert report.passed and len(report.layers) == len(_quant_linears(load_model(path)[0]))
    assert all(layer.rel_error is not None and 0 < layer.rel_error < 0.5 for layer in report.layers)


def _edit_config(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name,change,message", [
    ("autogptq-v1-g128", lambda q: q.update(bits=8), "qweight is .* 8-bit"),
    ("autogptq-v1-g128", lambda q: q.update(group_size=64), "scales is"),
    ("autoawq-gemm-g64", lambda q: q.update(group_size=128), "scales is"),
    ("ct-w4a16-g128", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "weight_packed is"),
    ("ct-w4a16-g128", lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "weight_zero_point"),
    ("ct-w4a16-g128", lambda q: q.update(quant_method="gptq", bits=4, group_size=128, format="gptq"), "qweight is missing"),
])
def test_config_that_disagrees_with_the_tensors_is_one_line(name, change, message, layouts, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(layouts[name][0], path)
    _edit_config(path, change)
    with pytest.raises(QuantkitError, match=message) as exc:
        load_model(path)
    assert "\n" not in str(exc.value) and "config and tensors disagree" in str(exc.value)


def _ct_with(change) -> dict:
    qc = ct_config(4, 128, True, False)
    change(qc)
    return {"quantization_config": qc}


@pytest.mark.parametrize("config,message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "unsupported quant_method 'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}},
     "checkpoint_format 'marlin'"),
    (_ct_with(lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})),
     "activation quantization"),
    (_ct_with(lambda q: q["config_groups"]["group_0"]["weights"].update(type="float", num_bits=8)), "float weights"),
    (_ct_with(lambda q: q.update(format="float-quantized") or q["config_groups"]["group_0"].update(format=None)),
     "format 'float-quantized'"),
    (_ct_with(lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"})), "KV-cache quantization"),
])
def test_unsupported_schemes_are_named(config, message):
    with pytest.raises(QuantkitError, match=message):
        read_quant_info(config)


def test_packed_shapes_from_headers(layouts):
    from quantkit.model.checkpoint import ShardReader
    from quantkit.model.quant_format import checkpoint_quant_info, packed_shapes
    from quantkit.model.checkpoint import read_config

    for name in ("autogptq-v1-g128", "autoawq-gemm-g64", "ct-w8a16-channel", "gptqmodel-v2-asym-dynamic"):
        path, expected = layouts[name]
        shapes = packed_shapes(ShardReader(path), checkpoint_quant_info(path, read_config(path)))
        assert {s.name: (s.out_features, s.in_features) for s in shapes} == {n: tuple(w.shape) for n, w in expected.items()}
        assert {s.fmt for s in shapes} == {LAYOUTS[name].kind.split("_")[0].replace("ct", "compressed-tensors")}


@pytest.mark.slow
def test_check_cli_reports_vllm_paths(layouts, tmp_path):
    from tests_support.cli import run_cli

    out = tmp_path / "report.json"
    code, output = run_cli("check", layouts["autogptq-v1-legacy-config"][0], "--nsamples", "1", "--seqlen", "16",
                           "--tp", "2,4", "--output", out)
    assert code == 0, output
    # legacy AutoGPTQ config has sym: every layer is Marlin-shaped at tp 1 (k/v: N = 2 heads x 32 = 64)
    assert "vLLM: 14 of 14 packed layers take the Marlin kernels" in output
    assert "tp 2: falls off Marlin: N=32 not a multiple of 64: model.layers.0.self_attn.k_proj" in output
    data = json.loads(out.read_text())
    assert data["vllm"]["marlin"]["model.layers.1.mlp.down_proj"] is None
    assert "K/4=64 not a multiple of group size 64" not in output  # 256 / 4 = 64 splits on g64 boundaries


@pytest.mark.slow
@pytest.mark.parametrize("name", ["autogptq-v1-legacy-config", "ct-w4a16-asym-g32"])
def test_eval_and_generate_cli_on_peer_layouts(name, layouts, tiny_llama, tmp_path):
    from tests_support.cli import run_cli, synthetic_calib

    path = layouts[name][0]
    text = synthetic_calib(tmp_path / "text.txt")
    code, output = run_cli("eval", path, "--base", tiny_llama, "--tasks", "ppl", "--ppl-text", text, "--seqlen", "64",
                           "--output", tmp_path / "r.json")
    assert code == 0, output
    report = json.loads((tmp_path / "r.json").read_text())
    assert "compressed-tensors" in json.dumps(report) or "gptq" in json.dumps(report)
    code, output = run_cli("generate", path, "--prompt", "Once upon a time", "--max-tokens", "4", "--temperature", "0")
    assert code == 0, output
