"""The 4-bit engine benchmark's run list (which checkpoints run with which opt-in CPU flags), and the int8 head
benchmark at toy size."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.bench.int4_engine import variants

MODELS = {"float": Path("f"), "4-bit GPTQ": Path("g"), "4-bit GPTQ + lm_head": Path("h")}


def test_each_flag_adds_the_runs_it_changes():
    assert [(n, a, h) for n, _, a, h in variants(MODELS, False, False)] == [
        ("float", False, None), ("4-bit GPTQ", False, None), ("4-bit GPTQ + lm_head", False, None)]
    runs = {n: (p, a, h) for n, p, a, h in variants(MODELS, True, True)}
    # int8 activations touch only 4-bit layers; the other head choice only a float head (not a packed one)
    assert runs["4-bit GPTQ + lm_head, int8 activations"] == (Path("h"), True, None)
    assert runs["float, int8 lm_head"] == (Path("f"), False, True)
    assert runs["4-bit GPTQ, float lm_head"] == (Path("g"), False, False)
    assert runs["4-bit GPTQ, int8 activations, float lm_head"] == (Path("g"), True, False)
    assert sorted(runs) == sorted(["float", "4-bit GPTQ", "4-bit GPTQ + lm_head", "4-bit GPTQ, int8 activations",
                                   "4-bit GPTQ + lm_head, int8 activations", "float, int8 lm_head",
                                   "4-bit GPTQ, float lm_head", "4-bit GPTQ, int8 activations, float lm_head"])


def test_int8_head_bench_runs_at_toy_size():
    from quantkit.kernels.cpu_linear import prepack_supported
    from quantkit.kernels.int8_cpu import int8_kernel_available

    if not (int8_kernel_available() and prepack_supported(torch.bfloat16)):
        pytest.skip("the int8 head benchmark needs a CPU with AVX-512 BF16")
    out = subprocess.run([sys.executable, "-m", "quantkit.bench.int8_head", "--shape", "64x256", "--ms", "1,8",
                          "--reps", "2", "--rounds", "1", "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    from quantkit.kernels.int4_cpu import extension

    columns = 8 if extension().has_amx() else 6  # with AMX: the head with its AMX path off, and that ratio
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "8"] and all(len(r) == columns for r in rows)
