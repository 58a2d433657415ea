"""The scale search as first written, one candidate at a time: the oracle of quantkit.quant.scale_search's fused,
vectorized search (the tests compare the two bit for bit) and the baseline of benchmarks/scale_search.py.

Self-contained on purpose (only the format's range_params and round_scale come from elsewhere): every step is the
plainest torch expression of its formula (the codes q clamped, then q - zero; the least-squares sums weighted by an
explicit importance of ones), the grid's points are tried in turn, each over every group, keeping a group's new
point only where its error is strictly lower, the zero's two shifts one after the other, and weights are searched
one by one, in row chunks of CHUNK_ELEMENTS weights.
"""

from __future__ import annotations

import torch

from quantkit.format.primitives import QuantScheme, range_params, round_scale
from quantkit.quant.scale_search import SearchGrid

CHUNK_ELEMENTS = 2**22  # weights searched at once


def reference_error(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                    maxq: int) -> torch.Tensor:
    """sum_j imp_j (w_j - scale (q_j - zero))^2 per group: w [..., G], imp broadcastable (None: 1), scale/zero [...]."""
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    q = torch.clamp(torch.round(w / s) + z, 0, maxq)
    err = (w - s * (q - z)) ** 2
    return (err if imp is None else err * imp).sum(-1)


def sequential_grid_params(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool,
                           grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grid, one point at a time: w [..., G] fp32 -> scale, zero, error [...]."""
    maxq = 2**bits - 1
    xmin, xmax = w.min(dim=-1).values, w.max(dim=-1).values
    best = [torch.ones_like(xmin), *range_params(xmin, xmax, bits, sym)]
    best.append(reference_error(w, imp, best[1], best[2], maxq))

    def trial(p: torch.Tensor) -> None:
        s, z = range_params(xmin * p, xmax * p, bits, sym)
        better = (err := reference_error(w, imp, s, z, maxq)) < best[3]
        best[:] = [torch.where(better, new, old) for new, old in zip((p, s, z, err), best)]

    for p in grid.coarse_shrinks(sym, imp is not None)[1:]:
        trial(torch.full_like(xmin, p))
    centre = best[0]
    for offset in grid.fine_offsets():
        p = centre + offset
        trial(torch.clamp(torch.clamp(p, max=1.0) if offset > 0 else p, min=1 - grid.shrink(sym, imp is not None)))
    return best[1], best[2], best[3]


def reference_refine(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                     err: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One weighted least-squares round with the codes fixed, kept where the error falls: scale, zero, error [...]."""
    maxq, tiny = 2**bits - 1, torch.finfo(torch.float32).tiny
    q = torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    a = torch.ones_like(w) if imp is None else imp.expand_as(w)
    if sym:
        c = q - zero.unsqueeze(-1)
        den = (a * c * c).sum(-1)
        s = (a * c * w).sum(-1) / den.clamp(min=tiny)
        z = zero
    else:
        n = a.sum(-1).clamp(min=tiny)
        qm, wm = (a * q).sum(-1) / n, (a * w).sum(-1) / n
        qc = q - qm.unsqueeze(-1)
        den = (a * qc * qc).sum(-1)
        s = (a * qc * (w - wm.unsqueeze(-1))).sum(-1) / den.clamp(min=tiny)
        z = torch.round(qm - wm / torch.where(s > 0, s, scale)).clamp(0, maxq)
    ok = (den > 0) & (s > 0) & torch.isfinite(s)
    s, z = round_scale(torch.where(ok, s, scale)), torch.where(ok, z, zero)
    better = (new_err := reference_error(w, imp, s, z, maxq)) < err
    return torch.where(better, s, scale), torch.where(better, z, zero), torch.where(better, new_err, err)


def reference_search(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool,
                     grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [...] of each group of w [..., G] fp32 (imp already floored): the grid, then per round the
    zero one code down, then up, then the least-squares fit."""
    maxq = 2**bits - 1
    scale, zero, err = sequential_grid_params(w, imp, bits, sym, grid)
    for _ in range(grid.refine):
        if not sym:
            for step in (-1.0, 1.0):
                z = torch.clamp(zero + step, 0, maxq)
                better = (new_err := reference_error(w, imp, scale, z, maxq)) < err
                zero, err = torch.where(better, z, zero), torch.where(better, new_err, err)
        scale, zero, err = reference_refine(w, imp, scale, zero, err, bits, sym)
    return scale, zero


def reference_weight_params(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                            grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """search_weight_params with the sequential grid, rows in chunks: scales, zeros [num_groups, N]."""
    n, k = w.shape
    g = scheme.group_len(k)
    imp3 = None if imp is None else imp.float().reshape(k // g, g)  # [groups, G]: broadcast over rows
    if imp3 is not None:  # the floor scale_search puts under the importance
        imp3 = imp3.clamp(min=float(imp3.mean()) * 1e-6 + torch.finfo(torch.float32).tiny)
    rows = max(1, CHUNK_ELEMENTS // k)
    found = [reference_search(w[a:a + rows].float().reshape(-1, k // g, g), imp3, scheme.bits, scheme.sym, grid)
             for a in range(0, n, rows)]
    return torch.cat([s for s, _ in found]).T.contiguous(), torch.cat([z for _, z in found]).T.contiguous()
