"""A data-free estimate of each input channel's mean square, read off the model's own weights.

The output error of a weight error dW in a linear is E||dW x||^2 = sum_k E[x_k^2] * ||dW[:, k]||^2 when the input
channels are uncorrelated: the importance imatrix measures on calibration data (quantkit.quant.imatrix). Without data,
the layer's weights still say much of it, under the assumption that a normalized hidden state has uncorrelated
channels of unit mean square:

  - a linear fed by an RMSNorm reads x = gamma * n: E[x_k^2] = gamma_k^2 (gamma + offset for Gemma's norms);
  - a linear fed by another linear F (v_proj -> o_proj, up_proj -> down_proj) reads F's output rows:
    E[y_j^2] = sum_k F[j, k]^2 E[x_k^2], F's own inputs' estimate carried through;
  - under GQA each v_proj row feeds every query head of its group;
  - a gated MLP's down_proj reads act(gate) * up: the up rows' estimate times E[act(g)^2] for g Gaussian with the
    gate rows' estimated variance (Gauss-Hermite quadrature), gate and up taken as independent; so does each expert
    of an MoE block, whose gate and up read the MLP norm's output.

The architecture knowledge (which op feeds which linears, which gates down_proj) is the spec's LinearGroups, as AWQ
reads it, and its ExpertsSpec. gpt-oss's experts (one gate_up projection, down reading (clamp(up) + 1) * glu(gate)) get the norm's
estimate for gate_up and none for down.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from quantkit.format.arch import ArchSpec, LinearGroup, get_submodule, head_counts

# Gauss-Hermite nodes for E[act(g)^2]: the integrand is smooth, 32 nodes are exact to fp32 for silu and gelu
QUADRATURE_NODES = 32


def norm_mean_square(weight: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """E[x_k^2] [K] of a normalized hidden state scaled by the norm's weight: (weight + offset)^2."""
    return (weight.float() + offset).square()


def output_mean_square(w: torch.Tensor, imp: torch.Tensor) -> torch.Tensor:
    """E[y_j^2] [N] of y = W x for W [N, K] and uncorrelated inputs of mean square imp [K]."""
    return w.float().square() @ imp.float()


@lru_cache(maxsize=4)
def _normal_quadrature(nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights with sum_i w_i f(x_i) ~ E[f(Z)], Z ~ N(0, 1)."""
    x, wts = np.polynomial.hermite_e.hermegauss(nodes)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(wts / math.sqrt(2 * math.pi), dtype=torch.float32)


def activation_mean_square(act, var: torch.Tensor, nodes: int = QUADRATURE_NODES) -> torch.Tensor:
    """E[act(g)^2] for g ~ N(0, var), elementwise over var [N]: probabilists' Gauss-Hermite quadrature."""
    x, wts = _normal_quadrature(nodes)
    g = var.float().clamp(min=0).sqrt().unsqueeze(-1) * x  # [N, nodes]
    return act(g).square() @ wts


def over_query_heads(imp_v: torch.Tensor, o_in: int, kv_heads: int) -> torch.Tensor:
    """The KV-head channels' estimate [kv_heads * head_dim] spread over o_proj's inputs [o_in]: each KV head's
    channels once for every query head of its group (consecutive query heads share a KV head)."""
    if imp_v.numel() == o_in:
        return imp_v
    return imp_v.view(kv_heads, -1).repeat_interleave(o_in // imp_v.numel(), dim=0).reshape(-1)


def gated_mean_square(up: torch.Tensor, gate: torch.Tensor | None, act) -> torch.Tensor:
    """E[(act(g) * u)^2] [N] for independent u and Gaussian g of mean squares up, gate [N]; up alone where the
    gate or the activation is unknown."""
    return up if gate is None or act is None else up * activation_mean_square(act, gate)


def _activation(model_config, name: str | None = None):
    from transformers.activations import ACT2FN

    name = name or getattr(model_config, "hidden_act", None) or getattr(model_config, "hidden_activation", None)
    return ACT2FN[name] if name in ACT2FN else None


def _weight(layer, name: str) -> torch.Tensor:
    return get_submodule(layer, name).weight.data


def _unweighted(layer, name: str) -> torch.Tensor:
    """Ones [K]: every input channel alike, the plain weight error."""
    return torch.ones(_weight(layer, name).shape[1])


def _fed_by_linear(layer, model_config, group: LinearGroup, estimates: dict[str, torch.Tensor]):
    """The estimate for a group fed by a linear's output rows (its tail where the feeder is fused)."""
    feeder = _weight(layer, group.feeder)
    o_in = _weight(layer, group.linears[0]).shape[1]
    rows = output_mean_square(feeder, estimates[group.feeder])
    if group.feeder_repeats_kv:  # v -> o
        heads, kv_heads = head_counts(model_config)
        v_rows = kv_heads * (o_in // heads)
        return over_query_heads(rows[-v_rows:] if group.feeder_tail else rows, o_in, kv_heads)
    up = rows[-o_in:] if group.feeder_tail else rows
    if group.gate is None:
        gate = None
    elif group.gate == group.feeder:  # fused [gate | up]
        gate = rows[:o_in]
    else:
        gate = output_mean_square(_weight(layer, group.gate), estimates[group.gate])
    return gated_mean_square(up, gate, _activation(model_config))


def layer_mean_squares(layer, spec: ArchSpec, model_config, names) -> dict[str, torch.Tensor]:
    """The estimate [K] of each linear in `names` (relative to the layer), from the layer's weights as they are now
    (call before quantizing them). A linear outside the spec's groups gets ones: the plain weight error."""
    estimates: dict[str, torch.Tensor] = {}
    for group in spec.groups:
        if group.feeder_is_norm:
            imp = norm_mean_square(_weight(layer, group.feeder), spec.norms.offset)
        else:
            imp = _fed_by_linear(layer, model_config, group, estimates)
        for name in group.linears:
            estimates[name] = imp
    return {name: estimates[name] if name in estimates else _unweighted(layer, name) for name in names}


def expert_mean_squares(layer, spec: ArchSpec, model_config, names) -> dict[str, torch.Tensor]:
    """The estimate [K] of one expert's linears `names` (ExpertsSpec.linears_of, relative to the layer): its gate
    and up (or gate_up) read the MLP norm's output, its down act(gate) * up (ones for a fused gate_up's down)."""
    x = spec.experts
    roles = {x.parse(n)[1]: n for n in names if x.parse(n) is not None}
    imp = norm_mean_square(_weight(layer, spec.norms.mlp_in), spec.norms.offset)
    out = {roles[r]: imp for r in ("gate", "up", "gate_up") if r in roles}
    if {"gate", "up", "down"} <= roles.keys():
        up, gate = (output_mean_square(_weight(layer, roles[r]), imp) for r in ("up", "gate"))
        out[roles["down"]] = gated_mean_square(up, gate, _activation(model_config, x.act))
    return {name: out[name] if name in out else _unweighted(layer, name) for name in names}
