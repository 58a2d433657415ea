"""The KV-cache huge-pages benchmark at toy size: a row per batch where THP and the C++ attention are here; else it
says why and exits non-zero."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_kv_huge_pages_bench_runs_at_toy_size():
    from quantkit.engine.huge_pages import thp_unavailable
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    out = subprocess.run([sys.executable, str(BENCHMARKS / "kv_huge_pages.py"), "--batches", "1,2", "--keys", "40",
                          "--rounds", "2", "--threads", "1"], capture_output=True, text=True, timeout=300)
    if thp_unavailable() is not None or cpu_attention() is None:
        assert out.returncode != 0
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("batch")]
    assert len(rows) == 2 and all(r.endswith("x") for r in rows)
