"""The AMX-INT8 W4A8 benchmark at toy size: on the amx level it times all three kernels and prints a row per M;
elsewhere it says what it needs and exits non-zero."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_int4_q8_amx_bench_runs_at_toy_size():
    from quantkit.kernels.int4_cpu import extension

    ext = extension()
    amx = ext is not None and hasattr(ext.dev, "set_int4_q8_amx_from_m") and ext.has_amx()
    args = ["--layers", "1", "--ms", "1,33", "--rounds", "1", "--reps", "1", "--threads", "1"]
    out = subprocess.run([sys.executable, str(BENCHMARKS / "int4_q8_amx.py"), *args], capture_output=True, text=True,
                         timeout=300)
    if not amx:
        assert out.returncode != 0 and "needs the amx level" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 33 |")]
    assert len(rows) == 2 and all(r.count("x |") == 2 for r in rows)
