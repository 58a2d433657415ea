"""kernels/linear_choice.py: the one ordered table that picks a quantized linear's CPU kernel, at every CPU level
this machine runs; its choice agrees with the kernels' own predicates (int4_cpu) and with what QuantLinear runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quantkit.kernels import int4_cpu
from quantkit.kernels.linear_choice import TABLE, LinearCase, choose, table_rows

pytestmark = pytest.mark.usefixtures("cpu_level")

CASES = [LinearCase(bits, g, dtype, bias, act, q8, None if bits == 4 and g in (32, 64, 128) else "no int4pack")
         for bits in (4, 8, 3) for g in (6, 32, 64, 128, 100) for dtype in (torch.float32, torch.bfloat16)
         for bias in (False, True) for act in (False, True) for q8 in (False, True)]


def _blocked(group_size: int, act_order: bool) -> int4_cpu.Int4Blocked:
    k = group_size * 4
    perm = torch.randperm(k) if act_order else None
    return int4_cpu.Int4Blocked(torch.zeros(1, k, 8, dtype=torch.uint8), torch.ones(1, 4, 2, 16), 16, group_size,
                                perm)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_choice_agrees_with_the_kernels_predicates(case):
    """The row chosen runs where int4_cpu's own predicates say its kernel takes the weight, and its crossover is
    the one int4_blocked_linear uses by default for those activations."""
    choice = choose(case)
    loaded = int4_cpu.unavailable() is None
    if case.bits != 4 or not loaded:
        assert choice.kernel.layout != "int4 blocks"
        want = "torch int4pack" if case.bits == 4 and case.torch_int4 is None else \
            "int8" if case.bits == 8 else "dense"
        assert choice.kernel.layout == want
        return
    w = _blocked(case.group_size, case.act_order)
    bf16 = case.dtype == torch.bfloat16 and int4_cpu.bf16_kernel(w)
    plain_q8 = case.int8_activations and not case.bias and not case.act_order
    q8 = bf16 and plain_q8 and int4_cpu.q8_kernel(w)
    q8_f32 = case.dtype == torch.float32 and plain_q8 and w.group_size % 4 == 0  # the AVX2 W4A8 kernel: every level
    amx = bf16 and int4_cpu.amx_kernel(w)
    q8_amx = q8 and int4_cpu.q8_amx_kernel(w)
    name = "AMX-INT8 int8-activation" if q8_amx else "AVX-512 VNNI int8-activation" if q8 \
        else "AMX + AVX-512 BF16" if amx else "AVX-512 BF16" if bf16 else "AVX2 int8-activation" if q8_f32 else "AVX2"
    assert choice.cpu_path == f"int4 (quantkit {name} kernel)"
    # W4A8 without AMX tiles: the VNNI kernel takes every M (prefill chunks too); on AMX-INT8 tiles its own crossover;
    # the VNNI kernel with AMX tiles (the machine's, whatever the group size: the dense tiles are oneDNN's bf16 GEMM on
    # AMX) and the other kernels, the crossover int4_blocked_linear uses
    ext = int4_cpu.extension()
    tiles = hasattr(ext, "has_amx") and ext.has_amx()
    want = int4_cpu.DENSE_FROM_M_Q8_AMX if q8_amx else int4_cpu.NEVER_DENSE if q8 and not tiles else \
        int4_cpu.DENSE_FROM_M_Q8_AVX2 if q8_f32 else \
        int4_cpu.dense_threshold(case.dtype, bf16, amx)
    assert choice.dense_from_m == want
    plain = not case.bias and not case.act_order
    f32 = case.dtype == torch.float32 and plain  # the fp32 AVX2 kernel; bf16 widened to fp32 goes through Python
    assert choice.direct == ("q8" if q8 or q8_f32 else "bf16" if bf16 and plain else "f32" if f32 else None)


def test_every_row_passed_over_says_why():
    choice = choose(LinearCase(3, 128, torch.bfloat16))
    assert choice.kernel.name == "dense" and len(choice.passed_over) == len(TABLE) - 1
    assert all(why.split(": ", 1)[1] for why in choice.passed_over)
    rows = dict(table_rows(LinearCase(3, 128, torch.bfloat16)))
    assert rows["dense"] == "chosen" and "3-bit weights" in rows["int4 (quantkit AVX2 kernel)"]


def test_rows_behind_the_chosen_one_that_would_run_are_said_so():
    rows = dict(table_rows(LinearCase(4, 128, torch.float32)))
    if int4_cpu.unavailable() is None:
        assert rows["int4 (quantkit AVX2 kernel)"] == "chosen" and rows["dense"] == "would run"
        assert rows["int4 (quantkit AVX-512 BF16 kernel)"] == "float32 activations"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_quantlinear_runs_the_row_chosen(dtype, int8_activations, bias):
    from quantkit.model.quant_linear import QuantLinear
    from tests_support.int4_checkpoints import checkpoint

    p = checkpoint(64, 128, 32, "gptq", sym=True)
    p = p if bias else replace(p, bias=None)
    layer = QuantLinear(p)
    path = layer.repack_for_cpu(dtype, int8_activations=int8_activations)
    choice = choose(LinearCase(4, 32, dtype, p.bias is not None, False, int8_activations, None))
    if choice.kernel.layout == "int4 blocks":
        assert path == choice.cpu_path
        assert (layer._direct is None) == (choice.direct is None)
        if layer._direct is not None:
            assert layer._direct.max_m == choice.dense_from_m and layer._direct.int8_activations == (choice.direct == "q8")
