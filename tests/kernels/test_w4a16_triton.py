"""The Triton W4A16 kernels (Triton's interpreter on CPU tensors) against two oracles: the
package's torch reference, and a dequantization written here from the documented layouts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from quantkit.kernels import w4a16_matmul  # noqa: E402
from quantkit.kernels.reference import w4a16_matmul_reference  # noqa: E402
from quantkit.kernels.triton_w4a16 import TileConfig, _effective_g_idx, w4a16_matmul_triton  # noqa: E402
from quantkit.format.packing import PackedLinear  # noqa: E402
from tests_support.kernel_inputs import random_packed as _random_packed  # noqa: E402

# K and N are not multiples of any tile size used below (BLOCK_K 32/64, BLOCK_N 32/64).
N, K = 72, 200
AWQ_ORDER_DOC = (0, 2, 4, 6, 1, 3, 5, 7)  # column 8c + AWQ_ORDER[i] sits in bits 4i..4i+3


def random_packed(layout: str, group: int, act_order: bool, n: int = N, k: int = K, seed: int = 0) -> PackedLinear:
    return _random_packed(layout, group, act_order, n, k, seed)


def documented_dequant(p: PackedLinear, group: int) -> torch.Tensor:
    """W_hat [N, K] fp32 read bit by bit from the layouts as documented in quantkit.format.packing."""
    qw, qz, s = p.qweight.long() & 0xFFFFFFFF, p.qzeros.long() & 0xFFFFFFFF, p.scales.float()
    n, k = s.shape[1], p.in_features
    kk = torch.arange(k).view(k, 1)
    nn_ = torch.arange(n).view(1, n)
    if p.layout == "awq":
        slot_of_col = torch.tensor([AWQ_ORDER_DOC.index(j) for j in range(8)])
        codes = (qw[kk, nn_ // 8] >> (4 * slot_of_col[nn_ % 8])) & 0xF  # [K, N]
        zshift = 4 * slot_of_col[torch.arange(n) % 8]
    else:
        codes = (qw[kk // 8, nn_] >> (4 * (kk % 8))) & 0xF
        zshift = 4 * (torch.arange(n) % 8)
    zeros = (qz[:, torch.arange(n) // 8] >> zshift) & 0xF  # [G, N]
    if p.layout == "gptq":
        zeros = zeros + 1
    g = p.g_idx.long() if p.g_idx is not None else torch.arange(k) // group
    return (s[g] * (codes - zeros[g]).float()).T  # [N, K]


def run_triton(p: PackedLinear, x: torch.Tensor, group: int, **kw) -> torch.Tensor:
    return w4a16_matmul_triton(x, p.qweight, p.qzeros, p.scales, layout=p.layout, group_size=group,
                               g_idx=p.g_idx, bias=p.bias.to(x.dtype), **kw)


def assert_matches(out: torch.Tensor, p: PackedLinear, x: torch.Tensor, group: int) -> None:
    ref = w4a16_matmul_reference(x, p.qweight, p.qzeros, p.scales, layout=p.layout, group_size=group,
                                 g_idx=p.g_idx, bias=p.bias.to(x.dtype))
    doc = (x.float() @ documented_dequant(p, group).T + p.bias.to(x.dtype).float()).to(x.dtype)
    assert out.shape == (x.shape[0], N) and out.dtype == x.dtype
    tol = dict(rtol=1e-4, atol=1e-4) if x.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out, doc, **tol)


CASES = [(layout, group, act) for layout in ("gptq", "gptq_v2", "awq") for group in (32, 64, 128)
         for act in (False, True) if not (layout == "awq" and act)]


@pytest.mark.parametrize(("layout", "group", "act_order"), CASES)
def test_kernels_match_both_oracles(layout, group, act_order):
    # M 1/7/16 take the split-K decode kernel, 33 the GEMM kernel; fp32 and bf16 both reach each.
    p = random_packed(layout, group, act_order)
    gen = torch.Generator().manual_seed(1)
    for m, dtype in ((1, torch.float32), (7, torch.bfloat16), (16, torch.float32), (33, torch.bfloat16)):
        x = torch.randn(m, K, generator=gen).to(dtype)
        assert_matches(run_triton(p, x, group), p, x, group)


@pytest.mark.parametrize(("group", "act_order", "split_k"), [(32, True, 3), (64, False, 3), (64, False, 1)])
def test_gemm_and_splitk_with_small_tiles(group, act_order, split_k):
    # Several M tiles grouped 2 at a time, several K steps per split, a split with no full block;
    # without act-order, group 64 over BLOCK_K 32 takes the one-group-per-block path; split 1
    # stores the decode output directly instead of adding into an fp32 buffer.
    p = random_packed("gptq", group, act_order=act_order, seed=3)
    tiles = TileConfig(block_m=16, block_n=32, block_k=32, group_m=2, split_k=split_k)
    gen = torch.Generator().manual_seed(2)
    for m in (5, 50):
        x = torch.randn(m, K, generator=gen)
        assert_matches(run_triton(p, x, group, tiles=tiles), p, x, group)


@pytest.mark.parametrize(("m", "split"), [(3, True), (3, False), (40, None)])
def test_autotuned_kernels_run_in_the_interpreter(m, split, monkeypatch):
    import quantkit.kernels.triton_w4a16 as launcher

    if split is not None:  # decode: the split-K kernel, or the direct-store GEMV configs
        monkeypatch.setattr(launcher, "_wants_split_k", lambda *a: split)
    p = random_packed("awq", 64, act_order=False, seed=4)
    x = torch.randn(m, K).to(torch.bfloat16)
    assert_matches(run_triton(p, x, 64, autotune=True), p, x, 64)


def test_trivial_g_idx_takes_the_blocked_path_and_gives_the_same_result():
    p = random_packed("gptq_v2", 64, act_order=False)
    assert p.g_idx is not None and _effective_g_idx(p.g_idx, K, 64) is None
    shuffled = p.g_idx.flip(0).contiguous()
    assert torch.equal(_effective_g_idx(shuffled, K, 64), shuffled)
    x = torch.randn(4, K)
    without = w4a16_matmul_triton(x, p.qweight, p.qzeros, p.scales, layout="gptq_v2", group_size=64)
    torch.testing.assert_close(run_triton(p, x, 64) - p.bias, without, rtol=1e-4, atol=1e-4)


def test_per_channel_group_size_minus_one():
    p = random_packed("awq", K, act_order=False, seed=5)
    x = torch.randn(20, K)
    out = w4a16_matmul_triton(x, p.qweight, p.qzeros, p.scales, layout="awq", group_size=-1, bias=p.bias)
    assert_matches(out, p, x, K)


def test_public_api_backends():
    p = random_packed("gptq", 128, act_order=False)
    x = torch.randn(2, K)
    args = (x, p.qweight, p.qzeros, p.scales)
    auto = w4a16_matmul(*args, layout="gptq", group_size=128, g_idx=p.g_idx, backend="auto")  # CPU: torch
    tri = w4a16_matmul(*args, layout="gptq", group_size=128, g_idx=p.g_idx, backend="triton")
    torch.testing.assert_close(tri, auto, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="backend"):
        w4a16_matmul(*args, layout="gptq", backend="cuda")


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {**a, "layout": "exl2"}, "unknown layout"),
    (lambda a: {**a, "x": a["x"][:, :-8]}, "qweight must be"),
    (lambda a: {**a, "qzeros": a["qzeros"][:, :-1]}, "qzeros must be"),
    (lambda a: {**a, "group_size": 32}, "groups"),
    (lambda a: {**a, "x": a["x"].to(torch.int32)}, "fp16, bf16 or fp32"),
])
def test_shape_contract_errors(change, message):
    p = random_packed("gptq_v2", 64, act_order=False)
    args = dict(x=torch.randn(2, K), qweight=p.qweight, qzeros=p.qzeros, scales=p.scales, layout="gptq_v2",
                group_size=64)
    args = change(args)
    with pytest.raises(ValueError, match=message):
        w4a16_matmul_triton(args.pop("x"), args.pop("qweight"), args.pop("qzeros"), args.pop("scales"), **args)


def test_interpreter_set_before_import_uses_the_module_itself(tmp_path: Path):
    # With TRITON_INTERPRET=1 from the start the kernel module is already interpreted; no private copy.
    script = textwrap.dedent("""
        import torch
        import quantkit.kernels.triton_w4a16_jit as jit
        from triton.runtime.interpreter import InterpretedFunction
        from quantkit.kernels.triton_w4a16 import kernel_module, w4a16_matmul_triton
        from quantkit.kernels.reference import w4a16_matmul_reference
        from quantkit.format.packing import pack
        from quantkit.format.primitives import QuantScheme, rtn_quantize
        assert isinstance(jit.gemm_kernel, InterpretedFunction)
        p = pack(rtn_quantize(torch.randn(16, 64), QuantScheme(4, 32, True)), "gptq")
        x = torch.randn(3, 64)
        out = w4a16_matmul_triton(x, p.qweight, p.qzeros, p.scales, layout="gptq", group_size=32, g_idx=p.g_idx)
        ref = w4a16_matmul_reference(x, p.qweight, p.qzeros, p.scales, layout="gptq", group_size=32)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert kernel_module(interpret=True) is jit
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
