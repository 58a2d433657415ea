"""kernels/gpu_check.sh: its dry run (every step at toy size, CPU tensors, Triton interpreter) writes
a report with every section and its numbers; a step that fails or overruns is recorded, not fatal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.bench.gpu_check import STEPS, StepResult, junit_counts, run_step
from quantkit.bench.gpu_report import TITLES, render

REPO = Path(__file__).resolve().parents[2]
ENV = {"mode": "dry run", "device": "CPU (Triton interpreter)", "torch": "t", "cuda": None, "triton": "x",
       "python": "3", "commit": "abc", "date": "today", "total_s": 1.0}


@pytest.mark.slow
def test_dry_run_writes_every_section_with_numbers(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "report"
    done = subprocess.run(["bash", "kernels/gpu_check.sh", "--dry-run", str(out)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=1500)
    report = (out / "gpu_check.md").read_text()
    assert done.returncode == 0, report + done.stderr[-3000:]
    for title in TITLES.values():
        assert f"## {title}" in report
    for step in STEPS:
        assert re.search(rf"^\| {step.name} \| ok \| [\d.]+ \| \d+ \|$", report, re.M), step.name
    tests = re.search(r"^(\d+) tests: (\d+) passed, 0 failed, 0 errors, 0 skipped", report, re.M)
    assert tests and int(tests[1]) == int(tests[2]) > 0
    assert re.search(r"^\| 128x72 \| 128 x 72 \| 20 \| \d+\.\d+ \|", report, re.M)  # the w4a16 table
    assert re.search(r"^2 decoder layers \(hidden 128.*\): \d+\.\d M parameters", report, re.M)
    assert re.search(r"^\| 2 \| \d+\.\d \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \| n/a \| \d+\.\d\d \|$", report, re.M)
    for label in (r"float \(bf16 on disk\)", r"GPTQ 4-bit \(W4A16 kernel\)"):  # tokens, s, tok/s, kernel calls
        assert re.search(rf"^\| {label} \| (float32|bfloat16) \| 16 \| \d+\.\d\d \| \d+\.\d \| [1-9]\d* \|$", report, re.M), label
    assert {s["name"] for s in json.loads((out / "gpu_check.json").read_text())["steps"]} == {s.name for s in STEPS}


def test_a_step_past_its_budget_is_killed_and_recorded(tmp_path):
    result = run_step("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                      1, tmp_path / "slow.log", dict(os.environ), tmp_path)
    assert result.status == "timed out after 1 s" and result.seconds < 30
    assert "started" in result.log_tail


def test_a_failing_step_keeps_its_log_and_the_others_still_render(tmp_path):
    result = run_step("gptq", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30,
                      tmp_path / "gptq.log", dict(os.environ), tmp_path)
    assert result.status == "failed (exit 3)" and result.log_tail == "boom"
    model = StepResult("model", "ok", 1.0, 75, figures={"layers": 2, "shape": "toy", "params_m": 1.5,
                                                          "disk_gib": 0.003, "seconds": 1.0})
    report = render(ENV, [model, result])
    assert "| gptq | failed (exit 3) |" in report and "**failed (exit 3)**" in report and "boom" in report
    assert "2 decoder layers (toy): 1.5 M parameters" in report


def test_junit_counts(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1" time="2.5">'
                   '<testcase classname="a" name="ok"/><testcase classname="a" name="bad"><failure/></testcase>'
                   '</testsuite></testsuites>')
    assert junit_counts(xml) == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2, "seconds": 2.5,
                                 "failed": ["a::bad"]}


def test_every_gpu_marked_test_lives_where_the_check_collects():
    """The tests step collects only files named GPU_TEST_FILES (a GPU image may lack what the others import): a GPU
    test elsewhere would silently never run there."""
    from quantkit.bench.gpu_check import GPU_TEST_FILES

    mark = re.compile(r"^\s*(pytestmark\s*=.*|@)pytest\.mark\.gpu\b", re.M)
    marked = {p for p in (REPO / "tests").rglob("*.py") if mark.search(p.read_text())}
    collected = set((REPO / "tests").rglob(GPU_TEST_FILES))
    assert marked and marked <= collected, sorted(str(p) for p in marked - collected)


def test_the_script_runs_with_an_interpreter_that_imports_quantkit(tmp_path):
    """Never whatever python3 comes first on PATH: here that one cannot import quantkit (another interpreter, say the
    system's beside a venv), and the script passes it over."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")
    (fake / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{fake}:{Path(sys.executable).parent}:{env['PATH']}"
    done = subprocess.run(["bash", "kernels/gpu_check.sh", "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = re.search(r"^gpu_check: (\S+)$", done.stderr, re.M)
    assert chosen and not chosen[1].startswith(str(fake)) and "installing" not in done.stderr
