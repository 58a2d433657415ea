"""The 4-bit engine benchmark's run list (which checkpoints run with which opt-in CPU flags), and the int8 head
benchmark at toy size."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from int4_engine import variants

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
