"""Issue 39's families through every command a user runs: `quantkit quantize` (GPTQ), `check` against the float
model, `eval` (perplexity and MMLU against the float model), `generate`, `serve` (/v1/completions through the openai
client, against the offline engine's tokens) and `plan`, on tiny random models of Phi-3, Gemma 3, Mixtral,
Qwen3-MoE and gpt-oss (and gpt-oss with MXFP4 experts, as OpenAI ships it)."""

from __future__ import annotations

import json

import pytest

from conftest import NEW_FAMILIES
from tests_support.cli import run_cli, synthetic_calib

TEXT = " ".join(f"story {i}: the little cat sat on the warm mat and looked at the big dog." for i in range(60))


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def quantized(request, tiny_family, tmp_path_factory):
    """(float model, its GPTQ checkpoint made by the CLI, a scratch folder)."""
    tmp = tmp_path_factory.mktemp(f"cli-{request.param}")
    model, out = tiny_family(request.param), tmp / "q"
    code, output = run_cli("quantize", model, "--out", out, "--method", "gptq", "--group-size", 32, "--calib",
                           synthetic_calib(tmp / "calib.txt"), "--nsamples", 8, "--seqlen", 64, "--threads", 1,
                           "--no-check")
    assert code == 0, output
    return model, out, tmp


def test_check_passes_against_the_float_model(quantized):
    model, qdir, tmp = quantized
    report = tmp / "check.json"
    code, output = run_cli("check", qdir, "--original", model, "--backend", "torch", "--output", report)
    assert code == 0, output
    data = json.loads(report.read_text())
    assert data["passed"] and data["layers"] and all(layer["rows"] > 0 for layer in data["layers"])


def test_eval_reports_perplexity_and_mmlu_against_the_float_model(quantized, mmlu_dir):
    model, qdir, tmp = quantized
    text, report = tmp / "text.txt", tmp / "eval.json"
    text.write_text(TEXT)
    code, output = run_cli("eval", qdir, "--base", model, "--mmlu-dir", mmlu_dir, "--subjects", "anatomy",
                           "--limit", 2, "--num-fewshot", 0, "--ppl-text", text, "--seqlen", 64,
                           "--cache-dir", tmp / "cache", "--threads", 1, "--output", report)
    assert code == 0, output
    data = json.loads(report.read_text())
    quant, base = data["quantized"], data["base"]
    assert 1 < base["ppl"] < 10_000 and quant["ppl"] != base["ppl"]
    assert data["delta"]["ppl_ratio"] == pytest.approx(quant["ppl"] / base["ppl"])
    assert 0 <= quant["mmlu_acc"] <= 1


def test_generate_and_serve_give_the_engines_tokens(quantized):
    _, qdir, tmp = quantized
    generate_and_serve_give_the_engines_tokens(qdir, tmp)


def test_gpt_oss_with_mxfp4_experts_is_served_and_quantized(tiny_family, tmp_path):
    """gpt-oss as OpenAI ships it (MXFP4 experts): generate and serve run it, and quantize makes a GPTQ checkpoint of
    it that check passes against it."""
    from tests_support.mxfp4 import mxfp4_twin

    mx, _ = mxfp4_twin(tiny_family("gpt_oss"), tmp_path / "twin")
    generate_and_serve_give_the_engines_tokens(mx, tmp_path)
    out = tmp_path / "q"
    code, output = run_cli("quantize", mx, "--out", out, "--method", "gptq", "--group-size", 32, "--calib",
                           synthetic_calib(tmp_path / "calib.txt"), "--nsamples", 8, "--seqlen", 64, "--threads", 1,
                           "--no-check")
    assert code == 0, output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    code, output = run_cli("check", out, "--original", mx, "--backend", "torch", "--output", tmp_path / "check.json")
    assert code == 0, output


def generate_and_serve_give_the_engines_tokens(qdir, tmp) -> None:
    """`quantkit generate` and the server's /v1/completions (through the openai client) give the offline engine's
    greedy tokens for a prompt."""
    import openai

    from quantkit.engine import LLM, SamplingParams
    from tests_support.serving import serve_in_thread, settings_for

    want = LLM(str(qdir), dtype="float32", max_model_len=128, num_threads=1).generate(
        ["the little cat"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    out = tmp / "gen.jsonl"
    code, output = run_cli("generate", qdir, "--prompt", "the little cat", "--max-tokens", 8, "--temperature", 0,
                           "--max-model-len", 128, "--dtype", "float32", "--threads", 1, "--output", out)
    assert code == 0, output
    assert json.loads(out.read_text().splitlines()[0])["token_ids"] == want.token_ids
    with serve_in_thread(settings_for(qdir, served_model_names=("m",), max_model_len=128)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="m", prompt="the little cat", max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)


def test_plan_reads_the_checkpoint(quantized):
    model, qdir, tmp = quantized
    code, output = run_cli("plan", qdir, "--gpu-memory", "24GiB", "--output", tmp / "plan.json")
    assert code == 0, output
    data = json.loads((tmp / "plan.json").read_text())
    assert (data["moe"] is None) == (data["shape"]["experts"] == 0)
