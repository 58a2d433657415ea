"""End to end through the CLI: tiny random Llama and the real stories260K model."""

import json
import math
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.model.loader import load_model
from tests_support.cli import run_cli, synthetic_calib

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def quantize(model, out, *extra, calib):
    code, output = run_cli("quantize", model, "--out", out, "--calib", calib, "--nsamples", "8", "--seqlen", "64",
                           *extra)
    assert code == 0, output
    return output


def record_fake_quant(monkeypatch):
    """Capture each layer's parameters as GPTQ left them (the fake-quantized model)."""
    from quantkit.quant.gptq_layer import GPTQMethod

    seen = {}
    real_quantize = GPTQMethod.quantize_layer

    def record(self, ctx):
        result = real_quantize(self, ctx)
        for name, p in ctx.layer.named_parameters():
            seen[f"{ctx.spec.layers}.{ctx.index}.{name}"] = p.detach().clone()
        return result

    monkeypatch.setattr(GPTQMethod, "quantize_layer", record)
    return seen


@pytest.mark.parametrize("extra", [(), ("--desc-act",), ("--no-sym",), ("--group-size", "32", "--no-static-groups", "--desc-act"),
                                   ("--no-static-groups",), ("--act-group-aware",),
                                   ("--act-group-aware", "--no-static-groups", "--group-size", "32"),
                                   ("--gptaq", "--act-group-aware")])
def test_reloaded_logits_match_fake_quantized_model(tiny_llama, tmp_path, monkeypatch, extra):
    seen = record_fake_quant(monkeypatch)
    out = tmp_path / "q"
    quantize(tiny_llama, out, *extra, calib=synthetic_calib(tmp_path / "c.txt"))
    qmodel, info = load_model(out)
    fake, _ = load_model(tiny_llama)
    fake.load_state_dict(seen, strict=False)
    ids = torch.randint(3, 500, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(qmodel(ids).logits, fake(ids).logits, rtol=1e-4, atol=1e-4)
    assert info.layout == ("gptq_v2" if "--no-sym" in extra else "gptq")
    assert info.desc_act == ("--desc-act" in extra)
    if "--gptaq" in extra:  # recorded as such, and true-sequential by default
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["gptaq"] is True and qc["true_sequential"] is True
    if "--act-group-aware" in extra:  # GAR: g_idx stays column // group in the checkpoint
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["act_group_aware"] is True and qc["desc_act"] is False
        group = int(extra[extra.index("--group-size") + 1]) if "--group-size" in extra else 128
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            g_idx = f.get_tensor("model.layers.0.mlp.down_proj.g_idx")
        assert torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // group)


def test_checkpoint_layout_and_metadata(tiny_llama, tmp_path):
    out = tmp_path / "q"
    quantize(tiny_llama, out, calib=synthetic_calib(tmp_path / "c.txt"))
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    for key in ("bits", "group_size", "desc_act", "sym", "damp_percent", "static_groups", "true_sequential",
                "checkpoint_format"):
        assert key in qc
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq" and qc["sym"] is True
    assert json.loads((out / "quantize_config.json").read_text()) == qc
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        qz = f.get_tensor("model.layers.0.mlp.down_proj.qzeros")
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (256 // 8, 128)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.scales").dtype == torch.float16
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mlp.up_proj.g_idx").dtype == torch.int32
    assert bool(((qz.to(torch.int64) & 0xFFFFFFFF) == 0x77777777).all())
    meta = json.loads((out / "quantkit_meta.json").read_text())
    assert len(meta["layers"]) == 2 and meta["calibration_token_sha256"]
    assert all(math.isfinite(v) for layer in meta["layers"] for v in layer["losses"].values())
    assert (out / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".q.tmp-*"))
    # a model this small quantizes without --low-memory unless asked; the passes' dtype is recorded
    assert meta["config"]["low_memory"] is False and meta["config"]["compute_dtype"] == "auto"
    assert any(n.startswith("calibration forward passes in ") for n in meta["notes"])


def test_low_memory_when_asked(tiny_llama, tmp_path, monkeypatch):
    import os

    from quantkit.commands.quantize import KERNEL_CACHE_ENTRIES
    from quantkit.memory import KERNEL_CACHE_ENV

    for name in KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "q"
    code, output = run_cli("quantize", tiny_llama, "--out", out, "--method", "gptq", "--group-size", "32",
                           "--calib", synthetic_calib(tmp_path / "c.txt"), "--nsamples", "2", "--seqlen", "32",
                           "--low-memory", "--compute-dtype", "float32")
    assert code == 0, output
    meta = json.loads((out / "quantkit_meta.json").read_text())
    assert meta["config"]["low_memory"] is True
    assert {os.environ.get(name) for name in KERNEL_CACHE_ENV} == {str(KERNEL_CACHE_ENTRIES)}  # oneDNN's, ideep's
    assert "calibration forward passes in float32: asked for (--compute-dtype float32)" in meta["notes"]


def test_sharded_output_loads_identically(tiny_llama, tmp_path):
    calib = synthetic_calib(tmp_path / "c.txt")
    quantize(tiny_llama, tmp_path / "one", calib=calib)
    quantize(tiny_llama, tmp_path / "many", "--max-shard-size-gb", "0.0001", calib=calib)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, _ = load_model(tmp_path / "one")
    b, _ = load_model(tmp_path / "many")
    ids = torch.randint(3, 500, (1, 20))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_dry_run_writes_nothing(tiny_llama, tmp_path):
    code, output = run_cli("quantize", tiny_llama, "--out", tmp_path / "q", "--dry-run")
    assert code == 0 and "14 linears would be packed" in output
    assert not (tmp_path / "q").exists()


def wikitext_ppl(model, tok, text_path, seqlen=256, windows=24) -> float:
    ids = torch.tensor(tok(text_path.read_text(), add_special_tokens=False, verbose=False)["input_ids"])
    nll = 0.0
    with torch.no_grad():
        for w in range(windows):
            x = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0)
            logits = model(x).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
    return math.exp(nll / (windows * (seqlen - 1)))


# The calibration passes in fp32 on every CPU (auto takes bf16 where the CPU computes it natively): the checkpoints,
# and so the floors of configs/accuracy_floors.toml, then do not depend on the machine beyond summation order.
FP32_PASSES = ("--compute-dtype", "float32")


def test_stories260k_group_size(stories_dir, wikitext_test, tmp_path):
    from transformers import AutoTokenizer

    code, output = run_cli("quantize", stories_dir, "--out", tmp_path / "g128", "--calib", wikitext_test)
    assert code == 2 and "no linear layer can be packed at group size 128" in output
    assert not (tmp_path / "g128").exists()
    calib_args = ("--calib", wikitext_test, "--nsamples", "16", "--seqlen", "256", "--group-size", "64", *FP32_PASSES)
    # name -> method and flags: symmetric RTN (the default), asymmetric RTN (AWQ's scheme), GPTQ, AWQ
    runs = {"rtn": ("rtn",), "rtn_asym": ("rtn", "--no-sym"), "awq": ("awq",), "gptq": ("gptq",)}
    for name, (method, *flags) in runs.items():
        code, output = run_cli("quantize", stories_dir, "--out", tmp_path / name, "--method", method, *flags,
                               *calib_args)
        assert code == 0, output
    assert "left float (15 linears)" in output  # (GPTQ's, the last run)
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert "model.layers.3.mlp.down_proj" in qc["modules_to_not_convert"]
    assert "-:^model\\.layers\\.3\\.mlp\\.down_proj$" in qc["dynamic"]
    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    ppl = {name: wikitext_ppl(load_model(tmp_path / name)[0], tok, wikitext_test) for name in runs}
    # a real checkpoint, the same on every machine: the calibrated methods ahead of RTN, asymmetric RTN ahead of
    # symmetric (GPTQ and AWQ lie within 0.2% of each other, and their order moved with the calibration's dtype)
    assert max(ppl["gptq"], ppl["awq"]) < ppl["rtn_asym"] < ppl["rtn"], ppl
    floors = tomllib.loads((REPO / "configs" / "accuracy_floors.toml").read_text())["stories260k_g64"]
    base = wikitext_ppl(load_model(stories_dir)[0], tok, wikitext_test)
    for method, limit in floors["max_ppl_ratio"].items():
        assert ppl[method] / base <= limit, (method, ppl[method] / base, limit)
    for method, limit in floors["max_ratio_to_rtn_asym"].items():
        assert ppl[method] / ppl["rtn_asym"] <= limit, (method, ppl[method], ppl["rtn_asym"], limit)


# [stories260k_g64_search] of configs/accuracy_floors.toml: name -> method and flags
SEARCHED = {"rtn_mse": ("rtn", "--scale-search", "mse"), "rtn_imatrix": ("rtn", "--scale-search", "imatrix"),
            "gptq_imatrix": ("gptq", "--scale-search", "imatrix"), "awq_both": ("awq", "--awq-duo-scaling", "both")}


def test_stories260k_searched_scales_and_duo_both_meet_their_floors(stories_dir, wikitext_test, tmp_path):
    """The searched group scales and AWQ's duo "both" on stories260K-hf (a fixed checkpoint), as
    test_stories260k_group_size: each under its floor (the RTN floors sit below min-max RTN's measured 1.117)."""
    from transformers import AutoTokenizer

    calib_args = ("--calib", wikitext_test, "--nsamples", "16", "--seqlen", "256", "--group-size", "64", *FP32_PASSES)
    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    ppl = {}
    for name, (method, *flags) in SEARCHED.items():
        code, output = run_cli("quantize", stories_dir, "--out", tmp_path / name, "--method", method, *flags,
                               *calib_args)
        assert code == 0, output
        ppl[name] = wikitext_ppl(load_model(tmp_path / name)[0], tok, wikitext_test)
    base = wikitext_ppl(load_model(stories_dir)[0], tok, wikitext_test)
    floors = tomllib.loads((REPO / "configs" / "accuracy_floors.toml").read_text())["stories260k_g64_search"]
    for name, limit in floors["max_ppl_ratio"].items():
        assert ppl[name] / base <= limit, (name, ppl[name] / base, limit)


def test_check_flag_runs_the_kernel_check(tiny_llama, tmp_path):
    output = quantize(tiny_llama, tmp_path / "q", "--check", calib=synthetic_calib(tmp_path / "c.txt"))
    assert "check: 14 packed layers" in output and "passed" in output


def test_awq_closing_table_shows_block_loss_and_scales(tiny_llama, tmp_path):
    output = quantize(tiny_llama, tmp_path / "q", "--method", "awq", calib=synthetic_calib(tmp_path / "c.txt"))
    assert "block loss RTN -> AWQ" in output and "AWQ scales" in output
    assert "quantkit quantize: awq -> awq" in output


def test_awq_closing_table_says_where_an_moe_layers_loss_is_measured(tiny_family, tmp_path):
    """With the experts streamed, AWQ's layer loss is the MoE block's input's (the experts are not in the layer for a
    whole run): the table says so."""
    output = quantize(tiny_family("qwen3_moe"), tmp_path / "q", "--method", "awq",
                      calib=synthetic_calib(tmp_path / "c.txt"))
    assert "loss RTN -> AWQ at the mlp input" in output and "block loss" not in output


def test_awq_duo_scaling_both_is_recorded_with_each_groups_formula(tiny_llama, tmp_path):
    """--awq-duo-scaling both: the mode in quantkit_meta.json's config, and per smoothing group which formula won."""
    out = tmp_path / "q"
    output = quantize(tiny_llama, out, "--method", "awq", "--awq-duo-scaling", "both",
                      calib=synthetic_calib(tmp_path / "c.txt"))
    meta = json.loads((out / "quantkit_meta.json").read_text())
    assert meta["config"]["awq_duo_scaling"] == "both"
    groups = [g for layer in meta["layers"] for g in layer["stats"]["groups"].values()]
    assert groups and all(isinstance(g["duo"], bool) and g["loss_scaled"] <= g["loss_unscaled"] for g in groups)
    duo = sum(g["duo"] for g in groups)
    assert f"duo formula in {duo} of {len(groups)}" in " ".join(output.replace("│", " ").split())


def _layer_losses(out):
    meta = json.loads((out / "quantkit_meta.json").read_text())
    return meta, {(layer["index"], name): v for layer in meta["layers"] for name, v in layer["losses"].items()}


def test_rtn_scale_search_mse_is_data_free_and_below_minmax_on_every_linear(tiny_llama, tmp_path):
    calib = synthetic_calib(tmp_path / "c.txt")
    quantize(tiny_llama, tmp_path / "minmax", "--method", "rtn", calib=calib)
    quantize(tiny_llama, tmp_path / "mse", "--method", "rtn", "--scale-search", "mse", calib=calib)
    _, minmax = _layer_losses(tmp_path / "minmax")
    meta, mse = _layer_losses(tmp_path / "mse")
    assert meta["config"]["scale_search"] == "mse" and meta["calibration_token_sha256"] is None  # no calibration read
    assert minmax.keys() == mse.keys() and all(mse[k] < minmax[k] for k in mse), (mse, minmax)


def test_rtn_scale_search_prior_is_data_free_and_weights_the_search(tiny_llama, tmp_path):
    """--scale-search prior reads no calibration, and its importance changes what the search picks: its codes
    differ from the unweighted search's, and its weight error (unweighted) is at or above that search's, which
    minimizes exactly that error."""
    calib = synthetic_calib(tmp_path / "c.txt")
    quantize(tiny_llama, tmp_path / "mse", "--method", "rtn", "--scale-search", "mse", calib=calib)
    output = quantize(tiny_llama, tmp_path / "prior", "--method", "rtn", "--scale-search", "prior", calib=calib)
    assert "uses no calibration data" in output
    _, mse = _layer_losses(tmp_path / "mse")
    meta, prior = _layer_losses(tmp_path / "prior")
    assert meta["config"]["scale_search"] == "prior" and meta["calibration_token_sha256"] is None
    assert prior.keys() == mse.keys()
    assert sum(prior.values()) > sum(mse.values()) and all(prior[k] >= mse[k] * 0.999 for k in prior), (prior, mse)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rtn_scale_search_prior_weights_an_moe_layers_experts_too(family, tiny_family, tmp_path):
    """Under --scale-search prior the experts' searches are weighted as well (expert_mean_squares): their weight
    errors move off the unweighted search's, as the dense linears' do. gpt-oss's experts get the MLP norm's estimate
    for gate_up only, and the tiny model's norms are all ones: there the search is the unweighted one, to the bit."""
    model, calib = tiny_family(family), synthetic_calib(tmp_path / "c.txt")
    quantize(model, tmp_path / "mse", "--method", "rtn", "--scale-search", "mse", calib=calib)
    quantize(model, tmp_path / "prior", "--method", "rtn", "--scale-search", "prior", calib=calib)
    _, mse = _layer_losses(tmp_path / "mse")
    _, prior = _layer_losses(tmp_path / "prior")
    experts = [k for k in prior if ".experts." in k[1]]
    assert experts and prior.keys() == mse.keys()
    moved = sum(prior[k] for k in experts) > sum(mse[k] for k in experts)
    assert moved if family == "qwen3_moe" else all(prior[k] == mse[k] for k in experts)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_scale_search_imatrix_reads_the_calibration(tiny_llama, tmp_path, method):
    out = tmp_path / "q"
    output = quantize(tiny_llama, out, "--method", method, "--scale-search", "imatrix",
                      calib=synthetic_calib(tmp_path / "c.txt"))
    meta = json.loads((out / "quantkit_meta.json").read_text())
    assert meta["config"]["scale_search"] == "imatrix" and meta["calibration_token_sha256"] is not None
    assert "uses no calibration data" not in output
