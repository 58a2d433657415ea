"""The compiled (GPU) path of the W4A16 kernels, checked without a GPU: Triton lowers them to
PTX and SASS for an H100/H200 (sm_90) here, so a frontend or type error in a branch the
interpreter never takes (fp16/bf16 tensor-core dots, the real autotune configs) fails in CI."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

POINTER_TYPES = {"qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*fp16", "g_idx_ptr": "*i32"}


@pytest.fixture(scope="module")
def jit_module():
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    from quantkit.kernels.triton_w4a16 import kernel_module

    module = kernel_module(interpret=False)  # compiled even when TRITON_INTERPRET=1 is set
    assert isinstance(module.gemm_kernel, JITFunction)
    return module


def compile_for_sm90(kernel, x_type: str, out_type: str, constexprs: dict, num_warps: int, num_stages: int):
    signature = {name: POINTER_TYPES.get(name, "i32") for name in kernel.arg_names}
    signature.update(x_ptr=f"*{x_type}", bias_ptr=f"*{x_type}", out_ptr=f"*{out_type}")
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "x_type", "layout", "act_order"), [
    ("gemm", "fp16", 0, True),  # GPTQ v1, act-order: per-row group gather, fp16 tensor-core dot
    ("splitk", "bf16", 2, False),  # AWQ, one group per K block, bf16 dot, fp32 atomics
    ("gemv", "fp16", 1, False),  # GPTQ v2 decode without a split: direct fp16 store
])
def test_kernels_compile_for_sm90(jit_module, kernel, x_type, layout, act_order, monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice of a default change
    if kernel == "gemm":
        fn, cfg, out_type = jit_module.gemm_kernel, jit_module.GEMM_CONFIGS[5], x_type
    elif kernel == "splitk":
        fn, cfg, out_type = jit_module.splitk_kernel, jit_module.SPLITK_CONFIGS[13], "fp32"
    else:
        fn, cfg, out_type = jit_module.splitk_kernel, jit_module.GEMV_CONFIGS[8], x_type
    constexprs = dict(GROUP_SIZE=128, LAYOUT=layout, HAS_G_IDX=act_order, HAS_BIAS=True, FP32_DOT=False,
                      **cfg.kwargs)
    if kernel != "gemm":
        constexprs["BLOCK_M"] = 16
    compiled = compile_for_sm90(fn, x_type, out_type, constexprs, cfg.num_warps, cfg.num_stages)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    assert "mma" in ptx  # the dot became tensor-core instructions
    atomics = re.search(r"\b(atom|red)\.global\.", ptx)  # often predicated: "@%p1 red.global.add.f32"
    assert bool(atomics) == (kernel == "splitk")  # only split-K adds partial sums atomically
