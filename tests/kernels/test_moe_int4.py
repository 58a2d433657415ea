"""The grouped 4-bit experts op (kernels/csrc/moe_int4_cpu.cpp, quantkit.kernels.moe_int4) against its pure-torch
reference, and bit for bit against the per-expert loop it replaces (each expert's gate|up and down through
int4_linear_bf16, SiLU through the fused op, the weighted outputs added in ascending expert order in bf16)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import int4_cpu, moe_int4
from quantkit.kernels.int4_cpu import Int4Blocked, pack_blocks

pytestmark = pytest.mark.usefixtures("cpu_level")  # every CPU level this machine runs (conftest.py)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32])
def dtype(request, cpu_level):
    """The activation dtype of the grouped op under test: bf16 (built from AVX-512 BF16), fp32 (every level)."""
    if (why := int4_cpu.unavailable()) is not None:
        pytest.skip(why)
    if not moe_int4.available(request.param):
        pytest.skip(f"the bf16 grouped experts op is built only where the compiler targets AVX-512 BF16 (level "
                    f"{cpu_level})")
    return request.param


def random_blocked(gen: torch.Generator, n: int, k: int, group_size: int, fp32_scales: bool) -> Int4Blocked:
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005
    scales = scales if fp32_scales else scales.half().float()  # exact in fp16: packed as fp16
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen)
    packed, sz = pack_blocks(codes, scales, zeros, group_size)
    return Int4Blocked(packed, sz, n, group_size, None)


def experts(num: int, hidden: int, inter: int, groups: tuple[int, int], fp32_scales: bool = False, seed: int = 0,
            max_m: int = 160) -> moe_int4.StackedExperts:
    """`num` random experts; gate|up in groups of groups[0] of the hidden columns, down of groups[1]."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = [random_blocked(gen, 2 * inter, hidden, groups[0], fp32_scales) for _ in range(num)]
    down = [random_blocked(gen, hidden, inter, groups[1], fp32_scales) for _ in range(num)]
    assert moe_int4.stackable(gate_up, down)
    return moe_int4.stack_experts(gate_up, down, {torch.bfloat16: max_m, torch.float32: max_m})


def routing(tokens: int, num: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num, generator=gen)
    weights, chosen = torch.topk(torch.softmax(logits, -1), k)
    return chosen, weights / weights.sum(-1, keepdim=True)


def per_expert_loop(x, chosen, weights, s: moe_int4.StackedExperts):
    """What the engine's MoE block computes per expert without the grouped op (its forward with 4-bit experts: bf16
    straight to the AVX-512 BF16 kernel, fp32 through int4_blocked_linear's AVX2 kernel)."""
    from quantkit.kernels import cpu_fused as ops
    from quantkit.model.moe import expert_batches

    ext = int4_cpu.extension()

    def linear(v, w):
        if v.dtype == torch.bfloat16:
            return ext.int4_linear_bf16(v, w.packed, w.scale_zero, w.out_features, w.group_size, True)
        return int4_cpu.int4_blocked_linear(v, w, None)

    out = torch.zeros_like(x)
    for b in expert_batches(weights, chosen, s.w1.shape[0]):
        w1, w2 = s.expert(b.expert)
        gate, up = linear(x.index_select(0, b.rows), w1).chunk(2, dim=-1)
        y = linear(ops.silu_and_mul(gate, up), w2)
        out[b.rows] += (y * b.weights[:, None]).to(out.dtype)
    return out


# (experts, hidden, intermediate, groups of gate|up and down): down's 40 outputs fill 2.5 blocks of 16; 256 columns
# in groups of 128
SHAPES = [(6, 64, 48, (32, 16)), (8, 40, 32, (8, 8)), (4, 256, 128, (128, 128))]


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 19])
@pytest.mark.parametrize(("num", "hidden", "inter", "groups"), SHAPES)
def test_grouped_experts_match_the_reference(dtype, tokens, num, hidden, inter, groups):
    s = experts(num, hidden, inter, groups, seed=tokens)
    chosen, weights = routing(tokens, num, 3, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = s(x, chosen, weights)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # bf16: the roundings of gate|up, SiLU, the product, down and each weighted sum against one fp32 pass
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), moe_int4.int4_moe_reference(x, chosen, weights, s).float(),
                               rtol=tol, atol=tol * got.float().abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 3, 8, 33])
@pytest.mark.parametrize("fp32_scales", [False, True])
def test_grouped_experts_equal_the_per_expert_loop_bit_for_bit(dtype, tokens, fp32_scales):
    s = experts(8, 64, 48, (32, 16), fp32_scales=fp32_scales, seed=3)
    chosen, weights = routing(tokens, 8, 2, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    assert torch.equal(s(x, chosen, weights), per_expert_loop(x, chosen, weights, s))


@pytest.mark.slow
def test_grouped_experts_take_no_tokens_and_refuse_bad_choices(dtype):
    s = experts(4, 64, 48, (32, 16))
    empty = s(torch.zeros(0, 64, dtype=dtype), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 64)
    x = torch.randn(2, 64).to(dtype)
    with pytest.raises(RuntimeError, match="out of range"):
        s(x, torch.tensor([[0, 4], [1, 2]]), torch.full((2, 2), 0.5))
    with pytest.raises(RuntimeError, match="weights must be fp32"):
        s(x, torch.tensor([[0, 1], [1, 2]]), torch.full((2, 2), 0.5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        int4_cpu.extension().int4_moe_f32(x.half(), torch.tensor([[0, 1], [1, 2]]), torch.full((2, 2), 0.5), s.w1,
                                          s.s1, s.gs1, s.w2, s.s2, s.gs2)


def test_the_grouped_call_takes_a_step_while_every_expert_is_below_its_crossover():
    s = experts(4, 64, 48, (32, 16), max_m=4)  # the loop would dequantize tiles from 4 rows of one expert
    spread = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 3]])  # 5 tokens: at most 3 rows an expert
    crowded = torch.tensor([[0, 1]] * 4 + [[2, 3]])  # experts 0 and 1 get 4 rows
    x = torch.zeros(5, 64)
    assert s.takes(x[:3], spread[:3]) and s.takes(x, spread) and not s.takes(x, crowded)
    assert not s.takes(x.half(), spread[:3])  # no grouped op for fp16


def test_experts_of_different_layouts_do_not_stack():
    gen = torch.Generator().manual_seed(0)
    gate_up = [random_blocked(gen, 96, 64, 32, False) for _ in range(2)]
    down = [random_blocked(gen, 64, 48, 16, False) for _ in range(2)]
    assert moe_int4.stackable(gate_up, down)
    assert not moe_int4.stackable(gate_up, [down[0], random_blocked(gen, 64, 48, 8, False)])  # group sizes differ
    assert not moe_int4.stackable(gate_up, [down[0], random_blocked(gen, 64, 48, 16, True)])  # scale dtypes differ
    permuted = Int4Blocked(gate_up[1].packed, gate_up[1].scale_zero, 96, 32, torch.arange(64))
    assert not moe_int4.stackable([gate_up[0], permuted], down)  # act-order
    assert not moe_int4.stackable(gate_up, [random_blocked(gen, 64, 32, 16, False)] * 2)  # down reads 2I = 96 rows


def test_each_expert_is_a_view_into_the_stack():
    s = experts(3, 64, 48, (32, 16))
    w1, w2 = s.expert(2)
    assert w1.packed.data_ptr() == s.w1[2].data_ptr() and w2.scale_zero.data_ptr() == s.s2[2].data_ptr()
    assert (w1.out_features, w2.out_features, w2.packed.shape[1]) == (96, 64, 48)
