"""Accuracy floors (configs/accuracy_floors.toml, tables `suite_NAME`) on every model of the accuracy suite.

Each model (quantkit.bench.suite) is quantized with each floored method as quantkit.bench.vs_llmcompressor
does it (the same flags, group size, calibration windows of seed 0, calibration passes in fp32 whatever the CPU,
and scoring), and its perplexity ratio
to float must stay under the floor. The `ci` models train here in fp32 when the cache lacks them (a few
tens of seconds each on two cores); the others are trained only by `python -m quantkit.bench.suite`, and
their tests skip, saying so, until the cache holds them.
"""

import tomllib
from pathlib import Path

import pytest

from tests_support.cli import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _floors(name: str) -> dict:
    tables = tomllib.loads((REPO / "configs" / "accuracy_floors.toml").read_text())
    key = f"suite_{name}"
    assert key in tables, f"configs/accuracy_floors.toml has no [{key}] table"
    return tables[key]


def _model_names() -> list[str]:
    from quantkit.bench.suite import SUITE

    return [m.name for m in SUITE]


@pytest.mark.parametrize("name", _model_names())
def test_suite_model_meets_its_floors(name, tmp_path):
    from conftest import shared_path
    from quantkit.bench import suite

    shared_path("wikitext2", "valid.txt")
    shared_path("wikitext2", "test.txt")
    model = suite.lookup(name)
    if not model.ci and suite.cached_path(model) is None:
        pytest.skip(f"{name} takes minutes to train, so CI does not: `python -m quantkit.bench.suite --models {name}` "
                    f"caches it under {suite.suite_dir()}")
    floors = _floors(name)
    ratios = _ratios(suite.ensure(model, show_progress=False), model.group, floors["max_ppl_ratio"], tmp_path)
    over = {m: (round(r, 4), floors["max_ppl_ratio"][m]) for m, r in ratios.items() if r > floors["max_ppl_ratio"][m]}
    assert not over, f"{name}: perplexity ratio over its floor (measured, floor): {over}"
    for better, worse in floors.get("ranking", []):
        assert ratios[better] < ratios[worse], (name, better, ratios[better], worse, ratios[worse])


def _ratios(model: Path, group: int, methods, tmp_path: Path) -> dict[str, float]:
    """Each method's perplexity ratio to float, quantized and scored as quantkit.bench.vs_llmcompressor."""
    from quantkit.bench.vs_llmcompressor import CALIB, FP32_PASSES, METHODS, NSAMPLES, SEQLEN, ppl_ratio_ours

    float_ppl, _ = ppl_ratio_ours(model, None)
    ratios = {}
    for method in methods:
        out = tmp_path / method
        code, output = run_cli("quantize", model, "--out", out, *METHODS[method][0], "--group-size", group,
                               "--calib", CALIB, "--nsamples", NSAMPLES, "--seqlen", SEQLEN, "--seed", "0",
                               "--threads", "2", *FP32_PASSES)
        assert code == 0, output
        ratios[method] = ppl_ratio_ours(out, float_ppl)[1]
    return ratios
