"""Accuracy floors (configs/accuracy_floors.toml) on the project's GQA test model.

The model is the one `python -m quantkit.bench.train_tiny --steps 100 --no-bf16` trains and caches: the floors
were measured on the 100-step model, which trains in about two minutes on this CPU, so the test trains
it when the cache lacks it (the 1600-step default of the benchmarks, which ranks the methods, takes
7.6 min to train here with native bf16 and far longer without: too long for CI). The
model is quantized as quantkit.bench.vs_llmcompressor does it and scored on the same text, so
the floors compare with docs/BENCHMARKS.md's table.

That model loses little to any 4-bit method, so its floors catch breakage only. The benchmarks'
1600-step model loses more; its floors are checked where the CPU computes bf16 natively, training it once
per machine (7.6 min here) when the cache lacks it, and skipped with the reason elsewhere.
"""

import tomllib
from pathlib import Path

import pytest

from tests_support.cli import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# method -> quantize flags beyond the defaults (the floors hold each method's defaults)
METHODS = {"rtn": ("--no-sym", "--format", "awq"), "gptq": (), "awq": ()}
FLOORS_STEPS = 100  # the training steps of the model the floors were measured on


def test_gqa_model_meets_its_floors(tmp_path):
    from dataclasses import replace

    from quantkit.bench.train_tiny import TinySpec, ensure_model

    model = ensure_model(spec=replace(TinySpec(), steps=FLOORS_STEPS), show_progress=False)
    floors = _floors("tiny_gqa_g128")
    ratios = _ratios(model, floors["max_ppl_ratio"], tmp_path)
    for method, limit in floors["max_ppl_ratio"].items():
        assert ratios[method] <= limit, (method, ratios[method], limit)


def test_ranking_gqa_model_meets_its_floors(tmp_path):
    """The benchmarks' 1600-step model: each method under its floor. It trains in 7.6 min under bf16 autocast
    (cached after the first run) and would take hours in fp32, so it needs native bf16. Its weights depend on
    the CPU's bf16 arithmetic, and the methods do not rank the same on every machine's model (configs/
    accuracy_floors.toml): the ranking is checked on stories260K-hf, a fixed checkpoint
    (tests/quant/test_quantize_cli.py::test_stories260k_group_size)."""
    from quantkit.bench.train_tiny import default_spec, ensure_model

    spec = default_spec()
    if not spec.bf16:
        pytest.skip("this CPU computes bf16 only by emulation: the 1600-step model would take hours to train")
    floors = _floors("tiny_gqa_g128_s1600")
    ratios = _ratios(ensure_model(spec=spec, show_progress=False), floors["max_ppl_ratio"], tmp_path)
    for method, limit in floors["max_ppl_ratio"].items():
        assert ratios[method] <= limit, (method, ratios[method], limit)


def _floors(table: str) -> dict:
    return tomllib.loads((REPO / "configs" / "accuracy_floors.toml").read_text())[table]


def _ratios(model: Path, methods, tmp_path: Path) -> dict[str, float]:
    """Each method's perplexity ratio to float, quantized and scored as quantkit.bench.vs_llmcompressor."""
    from conftest import shared_path
    from quantkit.bench.vs_llmcompressor import NSAMPLES, SEQLEN, ppl_ratio_ours

    calib = shared_path("wikitext2", "valid.txt")
    shared_path("wikitext2", "test.txt")
    float_ppl, _ = ppl_ratio_ours(model, None)
    ratios = {}
    for method in methods:
        out = tmp_path / method
        code, output = run_cli("quantize", model, "--out", out, "--method", method, *METHODS[method],
                               "--group-size", "128", "--calib", calib, "--nsamples", NSAMPLES,
                               "--seqlen", SEQLEN, "--seed", "0", "--threads", "2")
        assert code == 0, output
        ratios[method] = ppl_ratio_ours(out, float_ppl)[1]
    return ratios
