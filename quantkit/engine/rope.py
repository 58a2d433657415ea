"""Rotary position embeddings from an HF config: the default, linear, llama3 and yarn scaling types.

Pure functions. Frequencies follow transformers' conventions exactly (fp32, the rotate-half
layout), so greedy outputs match its models token for token.
"""

from __future__ import annotations

import math

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.fused_ops_reference import apply_rope, rotate_half  # noqa: F401 (the rotation lives with its fused twin)

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config, params: dict | None = None) -> dict:
    """The config's RoPE settings as one dict (transformers 5 keeps them in `rope_parameters`); `params`: one
    layer type's settings of a config that has several (layer_rope_parameters)."""
    params = dict((getattr(config, "rope_parameters", None) or {}) if params is None else params)
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in dict(legacy).items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def layer_rope_parameters(config) -> tuple[tuple[dict, ...], tuple[int, ...]]:
    """(the distinct RoPE settings, which of them each layer uses). Gemma 3 keys its rope_parameters by layer
    type (sliding layers rotate with base 10^4, full ones with 10^6 and maybe a linear factor); every other
    family has one setting for all layers."""
    params = getattr(config, "rope_parameters", None) or {}
    types = list(getattr(config, "layer_types", None) or [])
    if types and all(isinstance(params.get(t), dict) for t in set(types)):
        names = sorted(set(types))
        return tuple(rope_parameters(config, params[n]) for n in names), tuple(names.index(t) for t in types)
    return (rope_parameters(config),), (0,) * int(config.num_hidden_layers)


def inv_frequencies(params: dict, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """inv_freq [rot_dim / 2] fp32 for the rope type in `params`."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise QuantkitError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, max_position_embeddings)
    if rope_type == "yarn":
        return _yarn_scaling(params, dim, base, max_position_embeddings)
    return inv_freq


def attention_factor(params: dict) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' `attention_scaling`): 0.1 ln(factor) + 1, or
    the ratio of two such terms where the config gives mscale and mscale_all_dim; 1 for every other rope type.
    q and k both rotate with it, so the engine folds it into the attention scale as its square."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaling(params: dict, dim: int, base: float, max_position_embeddings: int) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn fewer than beta_slow times over the original context are divided by
    `factor`, those turning more than beta_fast times are kept, with a linear ramp over the dimensions between."""
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / old_len

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = base ** (torch.arange(0, dim, 2).float() / dim)  # as transformers forms them: equal bits
    return 1.0 / (factor * wavelengths) * ramp + 1.0 / wavelengths * (1 - ramp)


def _llama3_scaling(inv_freq: torch.Tensor, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 -> cos, sin [T, rot_dim] in `dtype` (computed in fp32)."""
    freqs = positions[:, None].float() * inv_freq[None, :].to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(inv_freq: torch.Tensor, positions: int, dtype: torch.dtype) -> torch.Tensor:
    """[positions, 2 * rot_dim]: row p is cos | sin of position p, as cos_sin computes them (the table a fused
    rotary reads by position, so that a step computes no cos and sin of its own)."""
    return torch.cat(cos_sin(inv_freq, torch.arange(positions), dtype), dim=-1)


class StepRope:
    """One step's rotary inputs: positions [T] int64, and `table` (rope_table in the compute dtype) where the
    engine built one that covers the step, else None. `cos_sin()` gives cos, sin [T, rot_dim] to the paths
    that take them, computed once per step on first use."""

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 table: torch.Tensor | None = None):
        self.inv_freq, self.positions, self.dtype, self.table = inv_freq, positions, dtype, table
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = cos_sin(self.inv_freq, self.positions, self.dtype)
        return self._cos_sin
