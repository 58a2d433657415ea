"""Each bad input: one clear line, a non-zero exit, and no output folder left behind."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests_support.cli import run_cli, synthetic_calib


def assert_clean_failure(code, output, out, pattern):
    assert code != 0
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert lines and "error" in lines[-1] and pattern in output, output
    assert "Traceback" not in output
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


@pytest.fixture()
def model_copy(tiny_llama, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def quantize(model, out, *extra):
    return run_cli("quantize", model, "--out", out, "--nsamples", "4", "--seqlen", "32", *extra)


def test_missing_path(tmp_path):
    out = tmp_path / "q"
    assert_clean_failure(*quantize(tmp_path / "nope", out), out, "no such folder")


def test_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "q"
    assert_clean_failure(*quantize("meta-llama/Llama-2-7b-hf", out), out, "offline")


def test_unsupported_architecture(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "q"
    code, output = quantize(model_copy, out)
    assert_clean_failure(code, output, out, "unsupported architecture")
    assert "LlamaForCausalLM" in output and "Qwen3ForCausalLM" in output


def test_truncated_and_corrupt_safetensors(model_copy, tmp_path):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    out = tmp_path / "q"
    assert_clean_failure(*quantize(model_copy, out), out, "truncated")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert_clean_failure(*quantize(model_copy, out), out, "corrupt")


@pytest.mark.parametrize("args,pattern", [(("--bits", "3"), "--bits"), (("--group-size", "48"), "--group-size"),
                                          (("--method", "smoothquant"), "unknown method"),
                                          (("--method", "awq", "--desc-act"), "act-order"),
                                          (("--desc-act", "--act-group-aware"), "choose one"),
                                          (("--method", "rtn", "--act-group-aware"), "--method gptq only"),
                                          (("--method", "awq", "--awq-duo-scaling", "maybe"), "--awq-duo-scaling"),
                                          (("--scale-search", "hqq"), "unknown --scale-search"),
                                          (("--method", "awq", "--scale-search", "mse"), "applies to --method rtn and gptq"),
                                          (("--method", "gptq", "--scale-search", "prior"), "applies to --method rtn")])
def test_unsupported_options(tiny_llama, tmp_path, args, pattern):
    out = tmp_path / "q"
    assert_clean_failure(*quantize(tiny_llama, out, *args), out, pattern)


def test_empty_calibration_set(tiny_llama, tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    out = tmp_path / "q"
    assert_clean_failure(*quantize(tiny_llama, out, "--calib", tmp_path / "empty.txt"), out, "empty")


def test_default_calibration_offline_says_how_to_pass_a_file(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "q"
    assert_clean_failure(*quantize(tiny_llama, out), out, "--calib FILE")


def test_existing_output_is_kept_without_force(tiny_llama, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, output = quantize(tiny_llama, out, "--calib", synthetic_calib(tmp_path / "c.txt"))
    assert code != 0 and "--force" in output
    assert (out / "precious.txt").read_text() == "keep me"


def test_nan_in_weights(model_copy, tmp_path):
    f = model_copy / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    out = tmp_path / "q"
    code, output = quantize(model_copy, out, "--calib", synthetic_calib(tmp_path / "c.txt"))
    assert_clean_failure(code, output, out, "NaN or inf")
    assert "model.layers.1.mlp.up_proj.weight" in output


def test_ctrl_c_mid_run_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    from quantkit.quant.gptq_layer import GPTQMethod

    calls = {"n": 0}
    real = GPTQMethod.quantize_layer

    def interrupted(self, ctx):
        calls["n"] += 1
        if ctx.index == 1:
            raise KeyboardInterrupt
        return real(self, ctx)

    monkeypatch.setattr(GPTQMethod, "quantize_layer", interrupted)
    out = tmp_path / "q"
    code, output = quantize(tiny_llama, out, "--calib", synthetic_calib(tmp_path / "c.txt"))
    assert code == 130 and "interrupted" in output and calls["n"] == 2
    assert not out.exists() and not list(tmp_path.glob(".q.tmp-*"))


def test_force_replaces_existing_output(tiny_llama, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "old.txt").write_text("old")
    code, output = quantize(tiny_llama, out, "--calib", synthetic_calib(tmp_path / "c.txt"), "--force")
    assert code == 0, output
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()


def tree_digest(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["same", "inside", "symlink", "parent"])
@pytest.mark.parametrize("force", [False, True])
def test_out_over_the_source_is_refused(model_copy, tmp_path, where, force):
    # the source must survive: --out on it (or inside it, or holding it) would replace its float weights
    before = tree_digest(model_copy)
    if where == "symlink":
        (tmp_path / "link").symlink_to(model_copy)
    out = {"same": model_copy, "inside": model_copy / "q", "symlink": tmp_path / "link",
           "parent": tmp_path}[where]
    code, output = quantize(model_copy, out, "--method", "rtn", *(["--force"] if force else []))
    assert code == 2 and "Traceback" not in output, output
    assert "--out" in output and "source model" in output, output
    assert tree_digest(model_copy) == before
    assert not (model_copy / "q").exists()


def test_rtn_says_it_uses_no_calibration(tiny_llama, tmp_path, monkeypatch):
    import quantkit.calibration.data as data

    def never(*args, **kwargs):
        raise AssertionError("RTN loaded calibration data")

    monkeypatch.setattr(data, "load_calibration", never)
    calib = synthetic_calib(tmp_path / "c.txt")
    code, output = quantize(tiny_llama, tmp_path / "q", "--method", "rtn", "--calib", calib)
    assert code == 0, output
    assert "warning: --method rtn uses no calibration data: --calib" in " ".join(output.split())
    # without --calib, nothing to warn about
    code, output = quantize(tiny_llama, tmp_path / "q2", "--method", "rtn")
    assert code == 0 and "calibration" not in output, output


def test_too_little_calibration_text_is_warned_loudly_and_refused_under_strict(tiny_llama, tmp_path):
    """A 7-token calibration file: every window repeats the same 7 tokens, so GPTQ fits its Hessians to 7 tokens
    and the result is no better than RTN. The run warns with the count and what it means (and records it in
    quantkit_meta.json); --strict refuses it, leaving nothing behind. Enough text gives no warning."""
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("Once upon a time there was")  # 7 tokens of the tiny BPE
    out = tmp_path / "q"
    code, output = quantize(tiny_llama, out, "--calib", tiny_text, "--seqlen", "64")
    assert code == 0, output
    warning = next((line for line in output.splitlines() if line.startswith("warning:")), "")
    assert "only 7 calibration tokens" in warning and "fewer than 64" in warning and "RTN" in warning, output
    assert json.loads((out / "quantkit_meta.json").read_text())["warnings"] == [warning.removeprefix("warning: ")]
    strict = tmp_path / "q-strict"
    code, output = quantize(tiny_llama, strict, "--calib", tiny_text, "--seqlen", "64", "--strict")
    assert_clean_failure(code, output, strict, "only 7 calibration tokens")
    assert "--strict" in output.strip().splitlines()[-1]
    enough = tmp_path / "q-enough"
    code, output = quantize(tiny_llama, enough, "--calib", synthetic_calib(tmp_path / "calib.txt"), "--strict")
    assert code == 0 and "warning:" not in output, output
    assert json.loads((enough / "quantkit_meta.json").read_text())["warnings"] == []


def test_a_layer_tensor_missing_from_the_checkpoint(model_copy, tmp_path):
    f = model_copy / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    out = tmp_path / "q"
    code, output = quantize(model_copy, out, "--method", "rtn")
    assert_clean_failure(code, output, out, "model.layers.1: the checkpoint lacks ['post_attention_layernorm.weight']")
