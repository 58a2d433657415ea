"""End to end: a GPTQ checkpoint of stories260K-hf (real trained weights) against its base."""

import json

import pytest

import typer
from typer.testing import CliRunner

from quantkit.commands import eval as eval_cmd


def invoke(*args):
    app = typer.Typer(pretty_exceptions_enable=False)
    app.callback()(lambda: None)
    eval_cmd.register(app)
    return CliRunner().invoke(app, ["eval", *map(str, args)])


@pytest.fixture(scope="module")
def stories_gptq(stories_dir, wikitext_test, tmp_path_factory):
    """`quantkit quantize <stories> --method gptq --group-size 64 --calib <wikitext> --nsamples 16 --seqlen 256`."""
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    out = tmp_path_factory.mktemp("stories-gptq") / "q"
    out.mkdir()
    cfg = QuantizeConfig(model=str(stories_dir), out=out, method="gptq", group_size=64,
                         calib=CalibConfig(source=str(wikitext_test), nsamples=16, seqlen=256))
    quantize_model(cfg, out, show_progress=False)
    return out


@pytest.mark.slow
def test_gptq_stories_against_base(stories_dir, stories_gptq, wikitext_test, mmlu_dir, tmp_path):
    text = tmp_path / "wiki-slice.txt"
    text.write_text(wikitext_test.read_text()[:30_000])  # ~19K tokens: ~75 windows of 256
    out = tmp_path / "report.json"
    result = invoke(stories_gptq, "--base", stories_dir, "--mmlu-dir", mmlu_dir, "--subjects",
                    "anatomy,marketing,philosophy", "--limit", 5, "--num-fewshot", 0, "--ppl-text", text,
                    "--seqlen", 256, "--no-cache", "--threads", 1, "--output", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert "gptq 4-bit, group size 64" in data["runtime"]["quantized"]["quantization"]
    assert data["runtime"]["base"]["quantization"] == "not quantized"
    # 4-bit g64 GPTQ of a 260K-parameter model costs some perplexity, but not a collapse
    assert 1.0 < data["delta"]["ppl_ratio"] < 1.5, data["delta"]
    assert 1 < data["base"]["ppl"] < 1000
    assert 0 <= data["quantized"]["mmlu_acc"] <= 1
    assert data["runtime"]["quantized"]["memory_bytes"] > 0
