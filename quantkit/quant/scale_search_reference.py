"""The scale search one candidate at a time: the oracle of quantkit.quant.scale_search's vectorized search (the tests
compare the two) and the baseline of benchmarks/scale_search.py.

The grid's points are tried in turn, each over every group, keeping a group's new point only where its error is
strictly lower; weights are searched one by one, in row chunks of CHUNK_ELEMENTS weights.
"""

from __future__ import annotations

import torch

from quantkit.format.primitives import QuantScheme, range_params
from quantkit.quant.scale_search import SearchGrid, group_error, search_params

CHUNK_ELEMENTS = 2**22  # weights searched at once


def sequential_grid_params(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool,
                           grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grid_params, one point at a time: w [..., G] fp32 -> scale, zero, error [...]."""
    maxq = 2**bits - 1
    xmin, xmax = w.min(dim=-1).values, w.max(dim=-1).values
    best = [torch.ones_like(xmin), *range_params(xmin, xmax, bits, sym)]
    best.append(group_error(w, imp, best[1], best[2], maxq))

    def trial(p: torch.Tensor) -> None:
        s, z = range_params(xmin * p, xmax * p, bits, sym)
        better = (err := group_error(w, imp, s, z, maxq)) < best[3]
        best[:] = [torch.where(better, new, old) for new, old in zip((p, s, z, err), best)]

    for p in grid.coarse_shrinks[1:]:
        trial(torch.full_like(xmin, p))
    centre = best[0]
    for offset in grid.fine_offsets():
        p = centre + offset
        trial(torch.clamp(torch.clamp(p, max=1.0) if offset > 0 else p, min=1 - grid.max_shrink))
    return best[1], best[2], best[3]


def reference_weight_params(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                            grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """search_weight_params with the sequential grid, rows in chunks: scales, zeros [num_groups, N]."""
    n, k = w.shape
    g = scheme.group_len(k)
    imp3 = None if imp is None else imp.float().reshape(k // g, g)  # [groups, G]: broadcast over rows
    rows = max(1, CHUNK_ELEMENTS // k)
    found = [search_params(w[a:a + rows].float().reshape(-1, k // g, g), scheme.bits, scheme.sym, imp3, grid,
                           sequential_grid_params) for a in range(0, n, rows)]
    return torch.cat([s for s, _ in found]).T.contiguous(), torch.cat([z for _, z in found]).T.contiguous()
