"""`quantkit check`: passes on checkpoints made by `quantkit quantize`, fails on corrupted copies
and on a kernel that disagrees with the reference; the AWQ fold bookkeeping undoes folds exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantkit.check.checkpoint import check_checkpoint
from quantkit.check.compare import awq_fold_scales, original_output, relative_max_diff, relative_output_error
from quantkit.cli import build_app
from quantkit.format.arch import spec_for, tie_over_query_heads
from quantkit.kernels.triton_w4a16 import triton_available
from tests_support.corrupt import corrupt, nan_every_seventh

CORRUPT_LAYER = "model.layers.1.mlp.up_proj"


def run_cli(*args: str):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    from quantkit.calibration.synthetic import make_corpus

    path = tmp_path_factory.mktemp("calib") / "stories.txt"
    path.write_text("\n\n".join(make_corpus(64, seed=1)))
    return path


@pytest.fixture(scope="module")
def rtn_ckpt(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "rtn-g32"
    done = run_cli("quantize", tiny_llama, "--method", "rtn", "--group-size", "32", "--out", out)
    assert done.exit_code == 0, done.output
    return out


@pytest.fixture(scope="module")
def gptq_act_order_ckpt(tiny_llama, calib_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "gptq-desc-act"
    done = run_cli("quantize", tiny_llama, "--method", "gptq", "--desc-act", "--group-size", "64",
                   "--calib", calib_file, "--nsamples", "4", "--seqlen", "64", "--out", out)
    assert done.exit_code == 0, done.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["rtn_ckpt", "gptq_act_order_ckpt"])
def test_check_passes_through_the_triton_kernel(which, tiny_llama, tmp_path, request):
    ckpt = request.getfixturevalue(which)
    report_file = tmp_path / "report.json"
    done = run_cli("check", ckpt, "--original", tiny_llama, "--backend", "triton", "--nsamples", "2",
                   "--seqlen", "32", "--max-rows", "24", "--output", report_file)
    assert done.exit_code == 0, done.output
    report = json.loads(report_file.read_text())
    assert report["passed"] and report["kernel_checked"] and report["backend"] == "triton"
    assert len(report["layers"]) == 14  # 2 layers x 7 linears, every one packed
    for layer in report["layers"]:
        assert layer["kernel_diff"] <= 1e-4, layer
        assert 0 < layer["rel_error"] < 0.3, layer


def flip_bit(t: torch.Tensor, bit: int) -> torch.Tensor:
    bits = t.view(torch.int16).clone()
    bits.view(-1)[::3] ^= 1 << bit
    return bits.view(t.dtype)


@pytest.mark.parametrize(("suffix", "fn"), [
    ("scales", lambda s: flip_bit(s, 13)),  # an exponent bit of every third fp16 scale
    ("qweight", lambda q: q ^ torch.randint(0, 2**31 - 1, q.shape, generator=torch.Generator().manual_seed(0),
                                            dtype=torch.int32)),  # random bit flips
])
def test_check_fails_on_a_corrupted_copy(suffix, fn, rtn_ckpt, tiny_llama, tmp_path):
    bad = corrupt(rtn_ckpt, tmp_path / "bad", f"{CORRUPT_LAYER}.{suffix}", fn)
    report_file = tmp_path / "report.json"
    done = run_cli("check", bad, "--original", tiny_llama, "--backend", "torch", "--nsamples", "2",
                   "--seqlen", "32", "--output", report_file)
    assert done.exit_code == 1, done.output
    report = json.loads(report_file.read_text())
    failed = [layer["name"] for layer in report["layers"] if not layer["passed"]]
    assert failed == [CORRUPT_LAYER]
    # the untouched copy passes the same check
    ok = run_cli("check", rtn_ckpt, "--original", tiny_llama, "--backend", "torch", "--nsamples", "2",
                 "--seqlen", "32")
    assert ok.exit_code == 0, ok.output


def test_check_fails_when_the_kernel_disagrees(rtn_ckpt, monkeypatch):
    import quantkit.kernels as kernels

    def off_by_one_percent(x, *args, **kwargs):
        return kernels.w4a16_matmul_reference(x, *args, **{k: v for k, v in kwargs.items() if k != "backend"}) * 1.01

    monkeypatch.setattr(kernels, "w4a16_matmul", off_by_one_percent)
    report = check_checkpoint(rtn_ckpt, backend="triton", nsamples=1, seqlen=16, show_progress=False)
    assert not report.passed and len(report.failures) == 14
    assert all("kernel disagrees" in layer.problems[0] for layer in report.failures)


def test_check_on_cpu_compares_both_paths_with_an_independent_dequantization(rtn_ckpt):
    report = check_checkpoint(rtn_ckpt, nsamples=1, seqlen=16, show_progress=False)
    assert report.passed and len(report.layers) == 14
    for layer in report.layers:
        assert layer.structure == [] and layer.model_diff is not None and layer.model_diff <= 1e-5, layer
    if triton_available():  # the interpreter on a sample of rows and output columns
        assert report.kernel_checked and report.backend == "triton"
        assert all(layer.kernel_diff <= 1e-4 and layer.kernel_rows > 0 and layer.kernel_cols > 0
                   for layer in report.layers)
        assert any("interpreter" in note for note in report.notes)


def test_check_without_original_fails_on_zeroed_scales(rtn_ckpt, tmp_path):
    bad = corrupt(rtn_ckpt, tmp_path / "bad", f"{CORRUPT_LAYER}.scales", torch.zeros_like)
    report_file = tmp_path / "report.json"
    done = run_cli("check", bad, "--nsamples", "1", "--seqlen", "16", "--output", report_file)
    assert done.exit_code == 1, done.output
    report = json.loads(report_file.read_text())
    failed = [layer for layer in report["layers"] if not layer["passed"]]
    assert [layer["name"] for layer in failed] == [CORRUPT_LAYER]
    assert "scales are not > 0" in failed[0]["problems"][0]
    assert "structure" in done.output  # the table names what it compared


def test_check_fails_when_the_torch_path_disagrees(rtn_ckpt, monkeypatch):
    from quantkit.model.quant_linear import QuantLinear

    real = QuantLinear.forward
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x: real(self, x) * 1.01)  # whichever CPU path runs
    report = check_checkpoint(rtn_ckpt, backend="torch", nsamples=1, seqlen=16, show_progress=False)
    assert not report.passed and len(report.failures) == 14
    assert all("model path disagrees" in layer.problems[0] for layer in report.failures)


def test_check_with_backend_torch_says_the_kernel_did_not_run(rtn_ckpt):
    report = check_checkpoint(rtn_ckpt, backend="torch", nsamples=1, seqlen=16, show_progress=False)
    assert report.passed and not report.kernel_checked
    assert all(layer.kernel_diff is None and layer.model_diff is not None for layer in report.layers)
    assert any("Triton kernel was not run" in note for note in report.notes)


def test_check_of_a_float_checkpoint_is_a_one_line_error(tiny_llama):
    done = run_cli("check", tiny_llama)
    assert done.exit_code == 2
    assert "not a quantized checkpoint" in done.output and "Traceback" not in done.output


def test_awq_folds_are_undone_exactly():
    # up_proj feeds down_proj (group "down"); the gate_up group reads the post-attention norm.
    spec = spec_for({"architectures": ["LlamaForCausalLM"]})
    gen = torch.Generator().manual_seed(0)
    w_up, w_down = torch.randn(48, 32, generator=gen), torch.randn(32, 48, generator=gen)
    s_gate_up, s_down = torch.rand(32, generator=gen) + 0.5, torch.rand(48, generator=gen) + 0.5
    plan = {"layers.3.gate_up.scale": s_gate_up, "layers.3.down.scale": s_down}
    col, row = awq_fold_scales(spec, plan, 3, "mlp.up_proj")
    assert torch.equal(col, s_gate_up) and torch.equal(row, s_down)
    assert awq_fold_scales(spec, plan, 2, "mlp.up_proj") == (None, None)  # another layer's plan
    folded_up = (w_up * s_gate_up) / s_down[:, None]  # what AWQ writes before quantizing
    x_f = torch.randn(10, 32, generator=gen)
    x_q = x_f / s_gate_up  # the folded norm hands the quantized model x / s
    y_q = x_q @ folded_up.T
    assert relative_output_error(y_q, original_output(x_q, w_up, None, col, row)) < 1e-5
    assert relative_output_error(y_q, original_output(x_q, w_up, None, None, None)) > 0.1
    col, row = awq_fold_scales(spec, plan, 3, "mlp.down_proj")
    assert torch.equal(col, s_down) and row is None
    assert (w_down.shape[1],) == tuple(col.shape)


def test_comparisons_treat_non_finite_outputs_as_failures():
    ref = torch.ones(2, 3)
    assert relative_max_diff(ref * 1.001, ref) == pytest.approx(1e-3, rel=1e-3)
    assert relative_max_diff(torch.full((2, 3), float("nan")), ref) == float("inf")
    assert relative_output_error(torch.full((2, 3), float("inf")), ref) == float("inf")


def tiny_llama_awq_plan(groups: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A plan for the tiny llama (hidden 128, intermediate 256, 4 heads / 2 KV heads: the v -> o scale
    is tied over the query heads of a KV head) with random scales in [0.5, 2) and clips too large to
    clip anything (every linear has one: AWQ clips q/k too)."""
    gen = torch.Generator().manual_seed(seed)
    plan = {}
    for i in range(2):
        for group, k in (("qkv", 128), ("o", 128), ("gate_up", 128), ("down", 256)):
            plan[f"layers.{i}.{group}.scale"] = torch.rand(k, generator=gen) * 1.5 + 0.5
        plan[f"layers.{i}.o.scale"] = tie_over_query_heads(plan[f"layers.{i}.o.scale"], 4, 2)
        for linear, n, k in (("self_attn.q_proj", 128, 128), ("self_attn.k_proj", 64, 128),
                             ("self_attn.v_proj", 64, 128), ("self_attn.o_proj", 128, 128),
                             ("mlp.gate_proj", 256, 128), ("mlp.up_proj", 256, 128), ("mlp.down_proj", 128, 256)):
            plan[f"layers.{i}.{linear}.clip"] = torch.full((n, k // groups), 1e4)
    return plan


@pytest.mark.slow
def test_awq_checkpoint_passes_only_with_its_folds_undone(tiny_llama, calib_file, tmp_path):
    # quantize --load-plan folds known scales (up_proj -> down_proj included); check must undo them.
    save_file(tiny_llama_awq_plan(groups=64), str(tmp_path / "plan.safetensors"))
    out = tmp_path / "awq"
    done = run_cli("quantize", tiny_llama, "--method", "awq", "--group-size", "64", "--calib", calib_file,
                   "--nsamples", "2", "--seqlen", "32", "--load-plan", tmp_path / "plan.safetensors", "--out", out)
    assert done.exit_code == 0, done.output
    good = check_checkpoint(out, original=tiny_llama, backend="torch", nsamples=2, seqlen=32, show_progress=False)
    assert good.passed and len(good.layers) == 14
    assert all(layer.rel_error < 0.3 for layer in good.layers)
    # The same checkpoint with a plan of ones: the folds are no longer undone and every layer fed
    # by a folded op, or feeding one, is far off.
    wrong = tmp_path / "awq-wrong-plan"
    shutil.copytree(out, wrong)
    plan = load_file(str(wrong / "awq_plan.safetensors"))
    save_file({k: torch.ones_like(v) if k.endswith(".scale") else v for k, v in plan.items()},
              str(wrong / "awq_plan.safetensors"))
    bad = check_checkpoint(wrong, original=tiny_llama, backend="torch", nsamples=2, seqlen=32, show_progress=False)
    assert not bad.passed
    failed = {layer.name.split(".", 3)[3] for layer in bad.failures}
    assert failed == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def test_non_finite_scales_fail_their_layer_and_the_layers_after_it_are_not_checkable(rtn_ckpt, tmp_path):
    """NaN scales in layer 0's q_proj: that layer fails (its own tensors), k_proj and v_proj (same input, before
    the NaN) pass, and every layer that the NaN reaches through the model path is reported as not checkable,
    not as failed: 1 failure, 11 not checkable, out of 14."""
    layer = "model.layers.0.self_attn.q_proj"
    bad = corrupt(rtn_ckpt, tmp_path / "bad", f"{layer}.scales", nan_every_seventh)
    report_file = tmp_path / "report.json"
    done = run_cli("check", bad, "--backend", "torch", "--nsamples", "1", "--seqlen", "16", "--output", report_file)
    assert done.exit_code == 1, done.output
    layers = {entry["name"]: entry for entry in json.loads(report_file.read_text())["layers"]}
    assert [n for n, e in layers.items() if e["problems"]] == [layer]
    assert "scales are not finite" in layers[layer]["problems"][0]
    downstream = [n for n, e in layers.items() if e["not_checkable"]]
    assert len(downstream) == 11 and all(not layers[n]["passed"] and not layers[n]["problems"] for n in downstream)
    assert [n for n, e in layers.items() if e["passed"]] == ["model.layers.0.self_attn.k_proj",
                                                             "model.layers.0.self_attn.v_proj"]
    assert "check failed: 1 of 14 layers" in done.output and "11 of 14 layers not checkable" in done.output
