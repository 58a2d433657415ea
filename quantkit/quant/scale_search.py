"""Each group's scale and zero by search, instead of its min and max: small pure functions.

Min-max spends the 16 codes of a 4-bit group on its extremes; shrinking the range (clipping the one or two largest
weights) rounds the many others finer. Per group (a row of G weights, vectorized over every leading dimension) the
search minimizes the importance-weighted error

    err(scale, zero) = sum_j imp_j * (w_j - scale * (q_j - zero))^2,   q_j = clamp(round(w_j / scale) + zero, 0, maxq)

with imp_j = 1 (`mse`: the weight error, data-free) or the mean square of the calibration inputs of input channel j
(`imatrix`: the expected output error of the group's partial dot products when the input channels are uncorrelated,
llm-compressor's imatrix_mse observer and llama.cpp's imatrix idea; GPTQ's diag(H) is the same statistic). Two steps:

  1. a grid over the range: [p * min, p * max] for p = 1, 1 - 1/steps, ... down to 1 - max_shrink (p = 1 is min-max);
  2. weighted least squares: with the best point's codes fixed, the scale (and for asymmetric groups the offset,
     rounded to an integral zero) that fit the weights best; kept only where the error falls.

So no group's error is ever above min-max's. Scales are rounded to fp16 as everywhere (format.primitives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.primitives import QuantizedWeight, QuantScheme, default_g_idx, range_params, round_scale

CHUNK_ELEMENTS = 2**22  # weights searched at once (a [chunk, ..., G] slice): bounds the temporaries


@dataclass(frozen=True)
class SearchGrid:
    """The grid over the range p = 1 - i / steps, i = 0 .. max_shrink * steps, walked coarse to fine: every
    `coarse`-th point first, then the points around each group's best coarse one."""

    steps: int = 100  # the grid's resolution
    max_shrink: float = 0.5  # the smallest range tried is (1 - max_shrink) of min-max's
    coarse: int = 5  # the coarse pass's stride, in grid points
    refine: int = 2  # weighted least-squares rounds after the grid

    @property
    def coarse_shrinks(self) -> list[float]:
        last = int(round(self.max_shrink * self.steps))
        return [1 - i / self.steps for i in range(0, last + 1, self.coarse)]

    def fine_offsets(self) -> list[float]:
        """The offsets from a group's best coarse point tried in the fine pass (the coarse points left out)."""
        return [i / self.steps for i in range(1 - self.coarse, self.coarse) if i]


def group_error(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                maxq: int) -> torch.Tensor:
    """sum_j imp_j (w_j - dequant_j)^2 per group: w [..., G], imp broadcastable to w (None: 1), scale/zero [...].
    One temporary the size of w, updated in place (the search is bound by memory traffic)."""
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    d = torch.div(w, s).round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s)  # dequantized
    d.sub_(w).square_()
    return (d if imp is None else d.mul_(imp)).sum(-1)


def grid_params(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool,
                grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: the best shrunk range per group. w [..., G] fp32 -> scale, zero, error [...] (ties: the wider range).
    The coarse points first (p = 1, min-max, among them), then each group's neighbourhood of its best one."""
    maxq = 2**bits - 1
    xmin, xmax = w.min(dim=-1).values, w.max(dim=-1).values
    lowest = 1 - grid.max_shrink
    best_p = torch.ones_like(xmin)
    best_s, best_z = range_params(xmin, xmax, bits, sym)
    best_err = group_error(w, imp, best_s, best_z, maxq)

    def trial(p: torch.Tensor) -> None:
        nonlocal best_p, best_s, best_z, best_err
        s, z = range_params(xmin * p, xmax * p, bits, sym)
        err = group_error(w, imp, s, z, maxq)
        better = err < best_err
        best_p, best_s, best_z, best_err = (torch.where(better, p, best_p), torch.where(better, s, best_s),
                                            torch.where(better, z, best_z), torch.where(better, err, best_err))

    for p in grid.coarse_shrinks[1:]:
        trial(torch.full_like(xmin, p))
    centre = best_p
    for offset in grid.fine_offsets():
        p = centre + offset
        if offset > 0:
            p = torch.clamp(p, max=1.0)
        trial(torch.clamp(p, min=lowest))
    return best_s, best_z, best_err


def refine_params(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                  err: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2, one round: the codes of (scale, zero) fixed, the weighted least-squares fit of w ~ s * q + b
    (symmetric: b = -s * zero with the zero fixed at the middle code), rounded to the format (fp16 scale, integral
    zero); kept per group where its error is lower. Returns scale, zero, error [...]."""
    maxq = 2**bits - 1
    q = torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    a = torch.ones_like(w) if imp is None else imp.expand_as(w)
    if sym:
        c = q - zero.unsqueeze(-1)
        den = (a * c * c).sum(-1)
        s = (a * c * w).sum(-1) / den.clamp(min=torch.finfo(torch.float32).tiny)
        z = zero
    else:
        n = a.sum(-1).clamp(min=torch.finfo(torch.float32).tiny)
        qm, wm = (a * q).sum(-1) / n, (a * w).sum(-1) / n
        qc = q - qm.unsqueeze(-1)
        den = (a * qc * qc).sum(-1)
        s = (a * qc * (w - wm.unsqueeze(-1))).sum(-1) / den.clamp(min=torch.finfo(torch.float32).tiny)
        s_safe = torch.where(s > 0, s, scale)
        z = torch.round(qm - wm / s_safe).clamp(0, maxq)  # w ~ s (q - z) with b = wm - s qm = -s z
    ok = (den > 0) & (s > 0) & torch.isfinite(s)
    s = round_scale(torch.where(ok, s, scale))
    z = torch.where(ok, z, zero)
    new_err = group_error(w, imp, s, z, maxq)
    better = new_err < err
    return torch.where(better, s, scale), torch.where(better, z, zero), torch.where(better, new_err, err)


def shift_zeros(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                err: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric groups: the zero one code down or up (the range slid by one step, clipping the other end), kept
    where the error falls. Returns zero, error [...]."""
    maxq = 2**bits - 1
    for step in (-1.0, 1.0):
        z = torch.clamp(zero + step, 0, maxq)
        new_err = group_error(w, imp, scale, z, maxq)
        better = new_err < err
        zero, err = torch.where(better, z, zero), torch.where(better, new_err, err)
    return zero, err


def search_params(w: torch.Tensor, bits: int, sym: bool, imp: torch.Tensor | None = None,
                  grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [...] of each group of w [..., G] (the grid, then the refinements); imp broadcastable to w
    (per input channel; None: the plain weight error). The same (scale, zero) convention as minmax_params."""
    w = w.float()
    imp = None if imp is None else _floored(imp.float())
    scale, zero, err = grid_params(w, imp, bits, sym, grid)
    for _ in range(grid.refine):
        if not sym:
            zero, err = shift_zeros(w, imp, scale, zero, err, bits)
        scale, zero, err = refine_params(w, imp, scale, zero, err, bits, sym)
    return scale, zero


def _floored(imp: torch.Tensor) -> torch.Tensor:
    """Importance with a floor (1e-6 of its mean): an input channel that never fired still counts a little, so the
    least-squares fits stay defined and its weights are not rounded arbitrarily."""
    return imp.clamp(min=float(imp.mean()) * 1e-6 + torch.finfo(torch.float32).tiny)


def search_weight_params(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                         grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """search_params over a whole weight W [N, K] (groups of G along K; imp [K] or None), N in chunks that bound the
    memory. Returns scales, zeros [num_groups, N], as QuantizedWeight holds them."""
    n, k = w.shape
    g = scheme.group_len(k)
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the group size {g}")
    imp3 = None if imp is None else imp.float().reshape(k // g, g)  # [groups, G]: broadcast over rows
    rows = max(1, CHUNK_ELEMENTS // k)
    scales, zeros = [], []
    for start in range(0, n, rows):
        w3 = w[start:start + rows].float().reshape(-1, k // g, g)  # [rows, groups, G]
        s, z = search_params(w3, scheme.bits, scheme.sym, imp3, grid)
        scales.append(s)
        zeros.append(z)
    return torch.cat(scales).T.contiguous(), torch.cat(zeros).T.contiguous()


def searched_quantize(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                      grid: SearchGrid = SearchGrid()) -> QuantizedWeight:
    """Round to nearest with searched group parameters: rtn_quantize's counterpart. w: [N, K] float."""
    scales, zeros = search_weight_params(w, scheme, imp, grid)
    n, k = w.shape
    g = scheme.group_len(k)
    s, z = scales.T.unsqueeze(-1), zeros.T.unsqueeze(-1)  # [N, groups, 1]
    codes = torch.clamp(torch.round(w.float().reshape(n, k // g, g) / s) + z, 0, scheme.maxq)
    return QuantizedWeight(codes.reshape(n, k).to(torch.uint8), scales, zeros, default_g_idx(k, scheme, w.device),
                           scheme)
