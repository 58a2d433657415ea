"""Pure-torch references of the decoder's fused CPU ops (kernels/csrc/fused_ops_cpu.cpp, wrapped by
cpu_fused.py), in the same functional form: each returns its results, the fused versions compute
them in place where they can. RMSNorm follows transformers' LlamaRMSNorm (in fp32, then back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels.paged_attention_reference import write_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * x / sqrt(mean(x^2) + eps)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next norm in one step."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rot_dim]. Rotates the first rot_dim dims of each head."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], cos/sin [T, rot_dim] in the rotate-half layout."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The attention block's step before attention, from the fused projection's output qkv [T, (Hq + 2 Hk) D]:
    q and k rotated by the rows `positions` [T] of `table` [n, 2D] (cos | sin), k and v stored at the caches'
    `slots` [T] (write_kv) -> q [T, Hq, D]."""
    d = key_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = table[positions].split([d, d], dim=-1)
    q, k = rotary(q.reshape(-1, num_heads, d), k.reshape(-1, num_kv_heads, d), cos, sin)
    write_kv(key_cache, value_cache, k, v.reshape(-1, num_kv_heads, d), slots)
    return q
