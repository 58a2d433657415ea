"""W4A16 dequant-matmul: one API over the Triton kernels (GPU, or CPU under TRITON_INTERPRET=1)
and the pure-torch reference (re-exported by quantkit.kernels)."""

from __future__ import annotations

import torch

from quantkit.kernels.reference import w4a16_matmul_reference
from quantkit.kernels.triton_w4a16 import triton_available

BACKENDS = ("auto", "torch", "triton")


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    layout: str,
    group_size: int = 128,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N], dtype of x; qweight/qzeros/scales exactly as stored on disk.

    layout: "gptq" (v1, zeros stored minus one), "gptq_v2", or "awq" (GEMM layout).
    backend: "triton", "torch" (the reference), or "auto" (Triton on CUDA, torch elsewhere).
    The Triton backend also takes CPU tensors: it then runs the kernels in Triton's interpreter
    (slow; for tests and checks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() else "torch"
    if backend == "torch":
        return w4a16_matmul_reference(x, qweight, qzeros, scales, layout=layout, group_size=group_size,
                                      g_idx=g_idx, bias=bias)
    from quantkit.kernels.triton_w4a16 import w4a16_matmul_triton

    return w4a16_matmul_triton(x, qweight, qzeros, scales, layout=layout, group_size=group_size,
                               g_idx=g_idx, bias=bias)


__all__ = ["w4a16_matmul", "w4a16_matmul_reference", "BACKENDS"]
