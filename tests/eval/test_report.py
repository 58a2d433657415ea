"""Metrics, paired deltas, the JSON keys and the gate, on hand-made results."""

import math

import pytest

from quantkit.eval.mmlu import MmluResult, SubjectResult, mean_and_stderr
from quantkit.eval.perplexity import PplProtocol, PplResult
from quantkit.eval.report import EvalReport, Gate, delta_metrics, model_metrics, render_table
from quantkit.eval.runner import ModelRun

PROTOCOL = PplProtocol("t.txt", 1000, 3, 256, 765, "one BOS")


def make_run(role: str, stem: list[bool], other: list[bool], ppl: float) -> ModelRun:
    mmlu = MmluResult({"anatomy": SubjectResult("stem", stem, [0] * len(stem)),
                       "marketing": SubjectResult("other", other, [1] * len(other))}, num_fewshot=0, truncated=2)
    return ModelRun(role, f"/{role}", mmlu, PplResult(ppl, 765 * math.log(ppl), PROTOCOL), wall_s=1.5,
                    memory_bytes=2**20)


BASE = make_run("base", [True, True, False, True], [True, False], 10.0)
QUANT = make_run("quantized", [True, False, False, True], [True, True], 12.5)


def test_model_metrics():
    m = model_metrics(BASE)
    assert m["mmlu_acc"] == pytest.approx(4 / 6)
    assert m["mmlu_acc_stem"] == pytest.approx(3 / 4)
    assert m["mmlu_acc_other"] == pytest.approx(1 / 2)
    assert "mmlu_acc_humanities" not in m  # no questions in that category
    assert m["mmlu_acc_stem_stderr"] == pytest.approx(0.25)  # sqrt(var_(n-1) / n) = sqrt(0.25 / 4)
    assert m["ppl"] == 10.0


def test_paired_delta():
    d = delta_metrics(BASE, QUANT)
    assert d["mmlu_acc"] == pytest.approx(0.0)  # one lost in stem, one gained in other
    diffs = [0, -1, 0, 0, 0, 1]
    assert d["mmlu_acc_stderr"] == pytest.approx(mean_and_stderr(diffs)[1])
    assert d["mmlu_acc_stem"] == pytest.approx(-0.25)
    assert d["ppl"] == pytest.approx(2.5) and d["ppl_ratio"] == pytest.approx(1.25)


def test_json_layout():
    data = EvalReport(BASE, QUANT, {"seqlen": 256}, ["a note"]).to_json()
    assert {"base", "quantized", "delta", "settings"} <= data.keys()
    for key in ("base", "quantized", "delta"):
        assert {"mmlu_acc", "mmlu_acc_stem", "mmlu_acc_other", "ppl"} <= data[key].keys()
        assert all(isinstance(v, float) for v in data[key].values())
    assert data["runtime"]["quantized"]["mmlu_truncated_contexts"] == 2
    assert "3 non-overlapping windows of 256" in data["runtime"]["base"]["ppl_protocol"]


def test_gate():
    delta = delta_metrics(BASE, QUANT) | {"mmlu_acc": -0.015}
    assert Gate().failures(delta) == []
    assert Gate(max_drop=2.0, max_ppl_ratio=1.3).failures(delta) == []
    fails = Gate(max_drop=1.0, max_ppl_ratio=1.2).failures(delta)
    assert len(fails) == 2 and "1.50 points" in fails[0] and "1.2500" in fails[1]


def test_table_renders():
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_table(EvalReport(BASE, QUANT, {})))
    text = console.export_text()
    assert "MMLU stem" in text and "75.00" in text and "x1.2500" in text and "-25.00" in text
