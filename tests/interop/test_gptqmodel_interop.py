"""GPTQModel against quantkit on the suite's smallest model (interop marker, run by hand; it starts GPTQModel's venv):
`python -m quantkit.bench.vs_llmcompressor --tools ours,gptqmodel --methods gptq,gptq-nogar` as a test.

    .venv/bin/python -m pytest -q -m interop tests/interop/test_gptqmodel_interop.py
Venv: ../venvs/gptqmodel (torch 2.13.0+cpu, gptqmodel 7.3.6, requests: docs/accuracy.md), or its python in
QUANTKIT_GPTQMODEL_PYTHON (as the benchmark's --gptqmodel-python).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from quantkit.bench.vs_llmcompressor import CALIB, DEFAULT_GPTQMODEL, bench_model, check_peer

pytestmark = pytest.mark.interop
GPTQMODEL = Path(os.environ.get("QUANTKIT_GPTQMODEL_PYTHON", DEFAULT_GPTQMODEL))


@pytest.mark.usefixtures("one_torch_thread")
def test_gptqmodel_quantizes_our_windows_and_quantkit_scores_its_checkpoint(tmp_path):
    """GPTQModel's GPTQ (GAR on, then off) on mha-w64-d4, seed 0: it reads the windows quantkit reads (one token hash),
    its checkpoints say the GAR they were made with, and quantkit loads and scores them within 2% of float."""
    if not GPTQMODEL.is_file():
        pytest.skip(f"no GPTQModel venv at {GPTQMODEL} (QUANTKIT_GPTQMODEL_PYTHON)")
    if not CALIB.is_file():
        pytest.skip(f"shared data not found at {CALIB}")
    assert check_peer(GPTQMODEL, "gptqmodel").startswith("gptqmodel ")
    rows = bench_model("mha-w64-d4", ["gptq", "gptq-nogar"], 1, {"gptqmodel": GPTQMODEL}, tmp_path,
                       {"ours", "gptqmodel"})
    assert [set(r) & {"ours", "peer", "gptqmodel"} for r in rows] == [{"ours", "gptqmodel"}, {"gptqmodel"}]
    assert {rows[0]["ours"]["hash"], rows[0]["gptqmodel"]["hash"], rows[1]["gptqmodel"]["hash"]} == {rows[0]["ours"]["hash"]}
    for row, gar in zip(rows, (True, False)):
        qc = json.loads((tmp_path / f"mha-w64-d4-{row['method']}-0-gptqmodel" / "quantize_config.json").read_text())
        assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == ("gptq", 4, 64, True, False)
        assert qc["meta"]["act_group_aware"] is gar
        assert 0.99 < row["gptqmodel"]["ratio"] < 1.02, row
    assert rows[0]["gptqmodel"]["ppl"] != rows[1]["gptqmodel"]["ppl"]  # GAR changes the result: the flag arrives
