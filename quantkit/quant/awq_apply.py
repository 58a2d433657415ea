"""Apply an AWQ plan to one decoder layer: fold scales into the feeding ops, clamp clips.

Folding a scale s [K] of a LinearGroup: every linear of the group gets W[:, k] *= s[k], and
the group's feeder divides its output channel k by s[k] (a norm's weight, or a feeding
linear's output row and bias), so the float layer computes the same function. Which op feeds
which group is the spec's data (quantkit.format.arch.LinearGroup); nothing here matches names.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.format.arch import LinearGroup, get_submodule, head_counts, kv_part
from quantkit.quant.awq_search import clip_weight


def fold_reason(layer: nn.Module, group: LinearGroup, model_config) -> str | None:
    """None when the group's scale can be folded into its feeder, else why not."""
    feeder = get_submodule(layer, group.feeder)
    out_channels = feeder.weight.shape[0]
    rep = 1
    if group.feeder_repeats_kv:
        heads, kv_heads = head_counts(model_config)
        rep = heads // kv_heads  # GQA: o_proj reads each v_proj row once per query head of its group
    for name in group.linears:
        k = get_submodule(layer, name).weight.shape[1]
        fits = k // rep <= out_channels if group.feeder_tail else k == out_channels * rep
        if not fits or k % rep:
            return f"{group.feeder} has {out_channels * rep} output channels but {name} reads {k}"
    return None


def feeder_scale(group: LinearGroup, s: torch.Tensor, model_config) -> torch.Tensor:
    """The feeder's share of a group's scale s [K]: s itself, or its KV-head channels under GQA
    (s is then tied over the query heads sharing a KV head: arch.tie_over_query_heads)."""
    return kv_part(s, *head_counts(model_config)) if group.feeder_repeats_kv else s


@torch.no_grad()
def fold_scale(layer: nn.Module, group: LinearGroup, s: torch.Tensor, model_config, norm_offset: float = 0.0,
               also_scaled: tuple[str, ...] = ()) -> None:
    """Divide the feeder's output channels by s [K] and multiply the group's input columns by s.

    norm_offset: a norm that scales by (offset + weight) (Gemma's 1 + w) gets (offset + w) / s - offset.
    also_scaled: float linears that read the group's input too (an MoE router): their columns are
    multiplied by s as well, so they see the same input as before the fold."""
    feeder = get_submodule(layer, group.feeder)
    s = s.to(feeder.weight.device)
    f = feeder_scale(group, s, model_config)
    if group.feeder_is_norm:
        _scale_norm(feeder, "weight", 1 / f, norm_offset)  # norm weight: [K]
        _scale_param(feeder, "bias", 1 / f)  # LayerNorm-style feeders only
    else:
        rows = slice(feeder.weight.shape[0] - f.numel(), None) if group.feeder_tail else slice(None)
        _scale_rows(feeder, "weight", (1 / f).unsqueeze(1), rows)  # feeding linear: rows [K_f, K_prev]
        _scale_rows(feeder, "bias", 1 / f, rows)
    scale_columns(layer, (*group.linears, *also_scaled), s)


@torch.no_grad()
def scale_columns(layer: nn.Module, names: tuple[str, ...], s: torch.Tensor) -> None:
    """W[:, k] *= s[k] for each linear `names` (the group's side of a fold: fold_scale, or on its own for linears
    read later than their feeder is folded, an MoE layer's streamed experts)."""
    for name in names:
        linear = get_submodule(layer, name)
        _scale_param(linear, "weight", s.to(linear.weight.device).unsqueeze(0))  # [N, K] columns


def _scale_param(module: nn.Module, attr: str, factor: torch.Tensor) -> None:
    """param *= factor, computed in fp32 and stored back in the parameter's dtype."""
    _scale_rows(module, attr, factor, slice(None))


def _scale_rows(module: nn.Module, attr: str, factor: torch.Tensor, rows: slice) -> None:
    """param[rows] *= factor (all rows: slice(None)), in fp32, stored back in the parameter's dtype."""
    p = getattr(module, attr, None)
    if p is None:
        return
    data = p.data.float()
    data[rows] = data[rows] * factor.float()
    p.data = data.to(p.dtype)


def _scale_norm(module: nn.Module, attr: str, factor: torch.Tensor, offset: float) -> None:
    """A norm's (offset + weight) multiplied by factor, in fp32: weight = (offset + weight) * factor - offset."""
    p = getattr(module, attr)
    p.data = ((p.data.float() + offset) * factor.float() - offset).to(p.dtype)


@torch.no_grad()
def apply_clip(linear: nn.Module, max_val: torch.Tensor) -> None:
    """Clamp the linear's weight [N, K] to [-max_val, max_val] per (row, group); max_val [N, G]."""
    w = linear.weight.data
    linear.weight.data = clip_weight(w.float(), max_val.to(w.device)).to(w.dtype)
