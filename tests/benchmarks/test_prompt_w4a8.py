"""The prompt-arithmetic TTFT benchmark at toy size: two engines on a tiny 4-bit checkpoint, one table row per
prompt length."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_prompt_w4a8_bench_runs_at_toy_size(tmp_path):
    from tests_support.cli import run_cli
    from tests_support.tiny_models import make_tiny_model

    dense = make_tiny_model(tmp_path / "m", hidden=256, intermediate=512, heads=4, kv_heads=2)
    code, output = run_cli("quantize", dense, "--out", tmp_path / "q", "--method", "rtn", "--group-size", "128")
    assert code == 0, output
    out = subprocess.run([sys.executable, str(BENCHMARKS / "prompt_w4a8.py"), str(tmp_path / "q"), "--lengths",
                          "8,40", "--rounds", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 8 |", "| 40 |"))]
    assert len(rows) == 2 and all(r.endswith("x |") for r in rows)
