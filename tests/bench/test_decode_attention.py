"""The decode attention benchmark at toy size: every prefetch setting runs, gives the same bits, and is timed."""

import subprocess
import sys

import pytest


def test_decode_attention_bench_runs_at_toy_size():
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    if cpu_attention() is None:
        pytest.skip("the C++ attention is not built here")
    out = subprocess.run([sys.executable, "-m", "quantkit.bench.decode_attention", "--batches", "1,2", "--keys", "40",
                          "--rounds", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("batch")]
    assert len(rows) == 10 and all("ms (best" in r for r in rows)
    assert "default: 1 blocks ahead" in out.stdout


def _git_checkout() -> bool:
    from quantkit.bench.kernel_revision import REPO

    return (REPO / ".git").exists()


def test_against_a_revision_that_names_no_commit_is_one_line_and_exits():
    if not _git_checkout():
        pytest.skip("not a git checkout")
    out = subprocess.run([sys.executable, "-m", "quantkit.bench.decode_attention", "--against", "no-such-revision",
                          "--batches", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr  # (a first run's compile may print before it)
    assert "--against no-such-revision: 'no-such-revision' names no commit" in out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_against_head_times_both_builds_in_one_process(tmp_path):
    """HEAD's kernel sources built as a second module beside the working tree's (about 45 s to compile here)."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    if cpu_attention() is None or not _git_checkout():
        pytest.skip("the C++ attention is not built here, or this is not a git checkout")
    out = subprocess.run([sys.executable, "-m", "quantkit.bench.decode_attention", "--against", "HEAD", "--batches",
                          "1,2", "--keys", "40", "--rounds", "2", "--threads", "1"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("batch")]
    assert len(rows) == 2 and all("HEAD / this tree per round" in r for r in rows)
    # the two builds compute the same attention: bf16 outputs within one rounding step of each other
    assert all(float(r.rsplit(" ", 1)[1]) < 1e-2 for r in rows)
