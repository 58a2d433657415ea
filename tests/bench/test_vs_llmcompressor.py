"""The llm-compressor comparison's table: runs joined per seed, and the mean line over seeds."""

from __future__ import annotations

import pytest

from quantkit.bench.vs_llmcompressor import mean_lines, merge_rows


def _side(ratio: float, wall: float, sha: str = "h") -> dict:
    return {"ratio": ratio, "ppl": 30 * ratio, "wall_s": wall, "hash": sha}


def test_split_runs_join_per_seed_and_keep_the_seeds_apart():
    rows = [{"model": "tiny", "method": "awq", "seed": s, "ours": _side(1.0 + s / 100, 2.0, f"h{s}")} for s in (0, 1)]
    rows += [{"model": "tiny", "method": "awq", "seed": s, "peer": _side(1.01, 4.0, f"h{s}")} for s in (0, 1)]
    merged = merge_rows(rows)
    assert [(m["seed"], set(m) & {"ours", "peer"}) for m in merged] == [(0, {"ours", "peer"}), (1, {"ours", "peer"})]


def test_a_seed_whose_windows_differ_between_the_tools_is_refused():
    rows = [{"model": "tiny", "method": "awq", "seed": 0, "ours": _side(1.0, 2.0, "a")},
            {"model": "tiny", "method": "awq", "seed": 0, "peer": _side(1.0, 4.0, "b")}]
    with pytest.raises(SystemExit, match="windows differ"):
        merge_rows(rows)


def test_the_mean_line_averages_ratios_and_seconds_over_seeds():
    rows = [{"model": "tiny", "method": "gptq", "seed": s, "ours": _side(r, w), "peer": _side(p, pw)}
            for s, r, w, p, pw in [(0, 1.002, 1.0, 1.004, 4.0), (1, 1.004, 3.0, 1.000, 4.0)]]
    (line,) = mean_lines(rows)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "**gptq, mean of 2 seeds**"
    assert cells[2] == "1.0030x (1.0020-1.0040)"
    assert cells[3] == "1.0020x (1.0000-1.0040)"
    assert cells[4:7] == ["2.00", "4.00", "0.50x"]
