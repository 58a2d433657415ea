"""The decoder's fused elementwise ops in C++ on CPU, fp32 or bf16 (in the extension quantkit_attn, built by
paged_attention_cpu.cpu_attention): RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary, and rotary with the
KV cache write (rope_and_cache); and the greedy sampler's argmax over fp32 rows (argmax_rows). Same
signatures as fused_ops_reference.py, the test oracle; results are computed in place where the
inputs are this step's temporaries (the caller's x, residual, q and k are overwritten)."""

from __future__ import annotations

import torch

from quantkit.kernels import fused_ops_reference
from quantkit.kernels.paged_attention_cpu import cpu_attention

DTYPES = (torch.float32, torch.bfloat16)  # what fused_ops_cpu.cpp computes (fp32 arithmetic, bf16 rounding)


def available(x: torch.Tensor) -> bool:
    """The fused ops run x's dtype and device: fp32 or bf16 on CPU with the extension built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and cpu_attention() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_attention().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = RMSNorm(residual). Returns (x, residual)."""
    cpu_attention().add_rms_norm_(x, residual, weight, eps)
    return x, residual


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return cpu_attention().silu_and_mul(gate, up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hk, D]; cos/sin [T, D]. Partial rotary: the reference."""
    if cos.shape[-1] != q.shape[-1]:
        return fused_ops_reference.rotary(q, k, cos, sin)
    cpu_attention().rotary_(q, k, cos.contiguous(), sin.contiguous())
    return q, k


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """q [T, Hq, D] rotated, k rotated and v stored at the caches' slots, from qkv [T, (Hq + 2 Hk) D] in one call."""
    return cpu_attention().rope_and_cache(qkv.contiguous(), positions, table, key_cache, value_cache, slots,
                                          num_heads, num_kv_heads)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a fp32 CPU [rows, n] (int64 [rows]; a NaN counts as the maximum, as there):
    in C++ where the extension builds (about 10x torch's on a 32000-wide row), else torch's."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0 \
            or cpu_attention() is None:
        return x.argmax(dim=-1)
    return cpu_attention().argmax_rows(x.contiguous())
