"""The int8 lm_head benchmark at toy size: where the bf16 int8 head builds it times every variant and prints a row
per M (the AMX tiles checked against vpdpbusd where granted); elsewhere it says what it needs and exits non-zero."""

import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_int8_head_bench_runs_at_toy_size():
    from quantkit.kernels.int8_cpu import int8_kernel_available

    args = ["--ms", "1,20", "--vocab", "300", "--rounds", "1", "--reps", "1", "--threads", "1"]
    out = subprocess.run([sys.executable, str(BENCHMARKS / "int8_head.py"), *args], capture_output=True, text=True,
                         timeout=300)
    if not int8_kernel_available(torch.bfloat16):
        assert out.returncode != 0 and "needs the int8 head" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    assert "lm_head 300 x 2048" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 1 |", "| 20 |"))]
    assert len(rows) == 2 and all(r.endswith("x |") for r in rows)
