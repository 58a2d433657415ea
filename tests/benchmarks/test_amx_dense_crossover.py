"""The AMX dense-crossover benchmark at toy size: on the amx level it times the three paths and prints a row per M;
elsewhere it says what it needs and exits non-zero."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_amx_dense_crossover_bench_runs_at_toy_size():
    from quantkit.kernels.int4_cpu import extension

    ext = extension()
    amx = ext is not None and hasattr(ext, "int4_q8_amx_takes") and ext.int4_q8_amx_takes(128)
    args = ["--ms", "3,40", "--rounds", "1", "--reps", "1", "--threads", "1"]
    out = subprocess.run([sys.executable, str(BENCHMARKS / "amx_dense_crossover.py"), *args], capture_output=True,
                         text=True, timeout=300)
    if not amx:
        assert out.returncode != 0 and "needs the amx level" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 3 |", "| 40 |"))]
    assert len(rows) == 2 and all(r.count("x |") == 2 for r in rows)
