"""quantkit.bench.w4a16 runs end to end (CPU, Triton interpreter, tiny shapes), so it runs
first time on a GPU; its torch dequantize baseline matches the package's dequantization."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("quantkit.bench.w4a16")


def test_torch_dequantize_baseline_matches_the_package(bench):
    from quantkit.format.packing import PackedLinear, dequantize

    _, qweight, qzeros, scales = bench.make_weight(96, 40, 32, torch.device("cpu"))
    expected = dequantize(PackedLinear("gptq", 4, 32, qweight, qzeros, scales), torch.float32)  # [N, K]
    got = bench.torch_dequantize(qweight, qzeros, scales.float(), 32)  # [K, N]
    torch.testing.assert_close(got.T, expected, rtol=0, atol=0)


def test_bench_smoke_run_writes_the_table(bench, tmp_path, capsys):
    out = tmp_path / "bench.md"
    assert bench.main(["--device", "cpu", "--shapes", "128x72", "--m", "1,20", "--group-size", "64",
                       "--iters", "1", "--out", str(out)]) == 0
    table = out.read_text()
    assert "CPU (Triton interpreter)" in table and "group 64" in table
    rows = [line for line in table.splitlines() if line.startswith("| 128x72 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["1", "20"]
    assert table in capsys.readouterr().out


def test_goal_column_follows_the_issue(bench):
    assert bench.goal(1, 3.2) == ">= 3x: met" and bench.goal(16, 2.9) == ">= 3x: missed"
    assert bench.goal(1024, 0.8) == ">= 0.77x: met" and bench.goal(4096, 0.7) == ">= 0.77x: missed"
    assert bench.goal(64, 0.1) == ""
