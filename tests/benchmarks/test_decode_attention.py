"""The decode attention benchmark at toy size: every prefetch setting runs, gives the same bits, and is timed."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_decode_attention_bench_runs_at_toy_size():
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    if cpu_attention() is None:
        pytest.skip("the C++ attention is not built here")
    out = subprocess.run([sys.executable, str(BENCHMARKS / "decode_attention.py"), "--batches", "1,2", "--keys", "40",
                          "--rounds", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("batch")]
    assert len(rows) == 10 and all("ms (best" in r for r in rows)
    assert "default: 1 blocks ahead" in out.stdout
