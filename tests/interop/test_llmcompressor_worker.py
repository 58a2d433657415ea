"""llm-compressor's worker as quantkit.bench.vs_llmcompressor runs it for a real shape (interop marker, run by hand; it
starts llm-compressor's venv): with --no-ppl it scores nothing and reports oneshot's time and its process's peak RSS.

    .venv/bin/python -m pytest -q -m interop tests/interop/test_llmcompressor_worker.py
Venv: ../venvs/llmcompressor (../shared/PEERS.md), or its python in QUANTKIT_LLMC_PYTHON (the benchmark's --llmc-python).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantkit.bench.vs_llmcompressor import CALIB, Windows, check_peer, model_entry, run_peer

pytestmark = pytest.mark.interop
LLMC = Path(os.environ.get("QUANTKIT_LLMC_PYTHON", Path(__file__).resolve().parents[3] / "venvs" / "llmcompressor"
                           / "bin" / "python"))


def test_the_unscored_worker_reports_time_and_peak_rss_and_no_perplexity(tmp_path):
    if not LLMC.is_file():
        pytest.skip(f"no llm-compressor venv at {LLMC} (QUANTKIT_LLMC_PYTHON)")
    if not CALIB.is_file():
        pytest.skip(f"shared data not found at {CALIB}")
    assert check_peer(LLMC, "peer").startswith("llmcompressor ")
    model, group, targets = model_entry("stories")
    r = run_peer(LLMC, model, tmp_path / "llmc", "gptq", group, targets, 1, skip_float=False,
                 ref=None, windows=Windows(4, 64))
    assert r["ppl"] is None and r["float_ppl"] is None
    assert r["wall_s"] > 0 and 0.2 < r["peak_rss_gib"] < 8  # torch and transformers alone hold a few hundred MiB
    assert len(r["hash"]) == 64
