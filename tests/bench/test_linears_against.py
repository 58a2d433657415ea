"""The linear kernels' A/B against a git revision's build (quantkit.bench.linears_against)."""

import subprocess
import sys

import pytest

from quantkit.bench.kernel_revision import REPO
from quantkit.kernels import int4_cpu

pytestmark = [pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout"),
              pytest.mark.skipif(int4_cpu.extension() is None, reason="the int4 kernel is not built here")]


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "quantkit.bench.linears_against", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_a_revision_that_names_no_commit_is_one_line_and_exits(tmp_path):
    out = run("no-such-revision", "--models-dir", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "no-such-revision: 'no-such-revision' names no commit" in out.stderr.strip().splitlines()[-1]
    assert not any(tmp_path.iterdir())  # refused before a checkpoint was made


@pytest.mark.slow
def test_against_head_times_both_builds_with_equal_outputs(tmp_path):
    """HEAD's int4 extension beside the working tree's over the benchmark checkpoint's linears (made in tmp_path)."""
    out = run("HEAD", "--models-dir", str(tmp_path), "--ms", "2", "--rounds", "1", "--threads", "1", timeout=900)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 |")]
    names = [r.split("|")[2].strip() for r in rows]
    assert names[:1] == ["int4"] and set(names) <= {"int4", "int8 lm_head"}  # (the int8 head needs AVX-512 VNNI)
    # the two builds compute the same products: equal, or within the fp32 summation order where the kernel changed
    assert all(float(r.split("|")[6]) < 1e-2 for r in rows)
