"""The pure comparisons `quantkit check` makes: relative differences, and what the original float
linear gives in an AWQ-folded layer's units."""

from __future__ import annotations

import torch

from quantkit.format.arch import kv_part
from quantkit.format.awq_plan import layer_prefix, scale_key


def relative_max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32; inf when either holds NaN or inf."""
    out, ref = out.float(), ref.float()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    scale = ref.abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    return float((out - ref).abs().max() / scale) if out.numel() else 0.0


def relative_output_error(y_q: torch.Tensor, y_f: torch.Tensor) -> float:
    """||y_q - y_f||_F / ||y_f||_F in fp32; inf when y_q is not finite."""
    y_q, y_f = y_q.float(), y_f.float()
    if not torch.isfinite(y_q).all():
        return float("inf")
    return float((y_q - y_f).norm() / y_f.norm().clamp(min=torch.finfo(torch.float32).tiny))


def original_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    col_scale: torch.Tensor | None, row_scale: torch.Tensor | None) -> torch.Tensor:
    """What the original linear gives, in the quantized layer's units.

    x [T, K] is the quantized model's input, which AWQ divided by col_scale [K]; the quantized
    linear's output rows (its last ones, for a fused feeder) were divided by row_scale [<= N] (it feeds a
    folded group). So the original sees x * col_scale, and its output is divided by row_scale to compare.
    """
    x = x.float()
    if col_scale is not None:
        x = x * col_scale.float()
    y = x @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if row_scale is not None:  # a fused feeder (Phi-3's gate_up_proj) folds its last rows only
        y[:, y.shape[1] - row_scale.numel():] /= row_scale.float()
    return y


def awq_fold_scales(spec, plan: dict[str, torch.Tensor], layer_index: int, linear: str,
                    heads: tuple[int, int] | None = None,
                    groups=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(col_scale [K], row_scale [N]) folded into `linear` (relative to its decoder layer) by AWQ.

    col_scale: the scale of the group the linear belongs to; row_scale: the scale of the group
    this linear feeds (when the feeder is a linear, e.g. up_proj -> down_proj). None: not folded.
    heads: (num_attention_heads, num_key_value_heads), for a v -> o scale tied over query heads (GQA).
    groups: the layer's AWQ groups (ArchSpec.awq_groups, with an MoE family's experts); default the dense ones.
    """
    prefix = layer_prefix(layer_index)
    col = row = None
    for group in spec.groups if groups is None else groups:
        scale = plan.get(prefix + scale_key(group.name))
        if scale is None:
            continue
        if linear in group.linears:
            col = scale
        if not group.feeder_is_norm and group.feeder == linear:
            row = kv_part(scale, *heads) if group.feeder_repeats_kv and heads else scale
    return col, row
