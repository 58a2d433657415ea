"""Each group's scale and zero by search, instead of its min and max: small pure functions.

Min-max spends the 16 codes of a 4-bit group on its extremes; shrinking the range (clipping the one or two largest
weights) rounds the many others finer. Per group (a row of G weights, vectorized over every leading dimension) the
search minimizes the importance-weighted error

    err(scale, zero) = sum_j imp_j * (w_j - scale * (q_j - zero))^2,   q_j = clamp(round(w_j / scale) + zero, 0, maxq)

with imp_j = 1 (`mse`: the weight error, data-free) or the mean square of the calibration inputs of input channel j
(`imatrix`: the expected output error of the group's partial dot products when the input channels are uncorrelated,
llm-compressor's imatrix_mse observer and llama.cpp's imatrix idea; GPTQ's diag(H) is the same statistic). Two steps:

  1. a grid over the range: [p * min, p * max] for p = 1, 1 - 1/steps, ... down to 1 - max_shrink (p = 1 is min-max;
     0.8 for the data-free search of asymmetric groups, else 0.5: SearchGrid.shrink);
  2. weighted least squares: with the best point's codes fixed, the scale (and for asymmetric groups the offset,
     rounded to an integral zero) that fit the weights best; kept only where the error falls.

So no group's error is ever above min-max's. Scales are rounded to fp16 as everywhere (format.primitives).

The grid's candidates are tried all at once, and a layer's linears are searched together, their groups laid end to
end and cut into bounded chunks, so that everything per group, not per weight (the candidates' ranges, the picks,
the refinements), runs over whole chunks. The candidates' errors come from a C++ kernel where it is built
(quantkit.kernels.group_error: a group read once, every candidate run over it in registers), else from its
pure-torch reference ([rows, candidates, G] temporaries in row slices that stay small, seven element-wise passes a
candidate, bound by memory traffic). With the reference the search chooses bit for bit what the search as first
written, one candidate at a time (scale_search_reference, the tests' oracle), chooses: every rewrite is exact in
floating point, and each group's error is summed over the same G values in the same order. The kernel computes the
same terms and sums them in another order, so where two candidates' errors are within a few ulps it may pick the
other one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.primitives import QuantizedWeight, QuantScheme, default_g_idx, range_params, round_scale
from quantkit.kernels.group_error import candidate_errors, group_error_reference, serves

# the reference's errors (no kernel): elements of the largest temporary ([rows, candidates, G] fp32, 4 MiB): a
# whole 2048 x 2048 weight at once (16 MiB, 11 candidates: 176 MiB) ran 3-4x slower from memory; much smaller
# chunks pay torch's per-call overhead (2**18 and 2**21 measured 0-25% slower on the suite and on a 2048 x 2048
# weight, one thread)
CHUNK_ELEMENTS = 2**20
# weights [rows, G] refined at once (the refinements' temporaries are [rows, G])
REFINE_ELEMENTS = 2**19


# How far the grid shrinks a group's range. The data-free search of an asymmetric group also moves its zero, so it
# has another way to fit its codes: on the suite's models its best point never lay below 0.79 of min-max's, and a
# grid cut at 0.8 (llm-compressor's MSE observer's maxshrink) chooses the same scales and zeros bit for bit
# (benchmarks/scale_search.py's digests, docs/BENCHMARKS.md) in 5 coarse points instead of 11. A symmetric group's
# codes are fixed around zero (its best points reach 0.69), and importance-weighted errors (imatrix) moved picks past
# 0.8: those grids go on to 0.5. The data-free importance (`prior`, quantkit.quant.weight_prior) keeps the data-free
# grid: on the suite its picks at 0.8 gave the same perplexity as at 0.5 on five models of seven and within 2e-5 on
# the other two (docs/BENCHMARKS.md), in half the candidates.
DATA_FREE_ASYM_MAX_SHRINK = 0.2
MAX_SHRINK = 0.5


@dataclass(frozen=True)
class SearchGrid:
    """The grid over the range p = 1 - i / steps, i = 0 .. max_shrink * steps, walked coarse to fine: every
    `coarse`-th point first, then the points around each group's best coarse one."""

    steps: int = 100  # the grid's resolution
    max_shrink: float | None = None  # the smallest range tried is (1 - max_shrink) of min-max's; None: see shrink
    coarse: int = 5  # the coarse pass's stride, in grid points
    refine: int = 2  # weighted least-squares rounds after the grid
    data_free: bool = False  # the importance is estimated without data: the data-free grid (see shrink)

    def shrink(self, sym: bool, weighted: bool) -> float:
        """max_shrink where set, else by the search's kind (DATA_FREE_ASYM_MAX_SHRINK, MAX_SHRINK)."""
        if self.max_shrink is not None:
            return self.max_shrink
        return MAX_SHRINK if sym or (weighted and not self.data_free) else DATA_FREE_ASYM_MAX_SHRINK

    def coarse_shrinks(self, sym: bool, weighted: bool) -> list[float]:
        last = int(round(self.shrink(sym, weighted) * self.steps))
        return [1 - i / self.steps for i in range(0, last + 1, self.coarse)]

    def fine_offsets(self) -> list[float]:
        """The offsets from a group's best coarse point tried in the fine pass (the coarse points left out)."""
        return [i / self.steps for i in range(1 - self.coarse, self.coarse) if i]


def group_error(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                maxq: int) -> torch.Tensor:
    """sum_j imp_j (w_j - dequant_j)^2 per group: w [R, G] with scale / zero [R] (one candidate a group) or [R, C]
    (C candidates: err [R, C]); imp [R, G] or None (1). The C++ kernel where it is built (quantkit.kernels.group_error:
    the same terms, summed in another order), else the pure-torch reference over [R, C, G] temporaries (any leading
    dimensions)."""
    err = candidate_errors(w, imp, scale, zero, maxq)
    if err is not None:
        return err
    if scale.dim() < w.dim():  # one candidate a group
        return group_error_reference(w, imp, scale, zero, maxq)
    return group_error_reference(w.unsqueeze(-2), None if imp is None else imp.unsqueeze(-2), scale, zero, maxq)


def candidate_params(w: torch.Tensor, imp: torch.Tensor | None, xmin: torch.Tensor, xmax: torch.Tensor,
                     p: torch.Tensor, bits: int, sym: bool,
                     rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every candidate range [p * xmin, p * xmax] of every group at once: w [..., G], imp broadcastable to w (or None),
    xmin / xmax [...], p [..., C] (or [C]) -> scale, zero, error [..., C]. The temporary is [..., C, G]; with `rows`
    (w [R, G], imp [R, G] or None) the errors are taken `rows` groups at a time, which bounds it to [rows, C, G]
    (the same errors: each group's is its own sum)."""
    s, z = range_params(xmin.unsqueeze(-1) * p, xmax.unsqueeze(-1) * p, bits, sym)
    maxq = 2**bits - 1
    if rows is None or rows >= len(w) or serves(w):  # the kernel's temporaries are registers
        return s, z, group_error(w, imp, s.expand(*w.shape[:-1], -1), z.expand(*w.shape[:-1], -1), maxq)
    s, z = s.expand(len(w), -1), z.expand(len(w), -1)
    err = [group_error(w[a:a + rows], None if imp is None else imp[a:a + rows], s[a:a + rows], z[a:a + rows], maxq)
           for a in range(0, len(w), rows)]
    return s, z, torch.cat(err)


def _pick(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, err: torch.Tensor):
    """Each group's first candidate of the lowest error (as a walk that keeps only strictly lower errors):
    [..., C] each -> [...] each."""
    i = err.argmin(-1, keepdim=True)
    return tuple(t.expand_as(err).gather(-1, i).squeeze(-1) for t in (p, s, z, err))


def grid_params(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool, grid: SearchGrid = SearchGrid(),
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: the best shrunk range per group. w [..., G] fp32 -> scale, zero, error [...] (ties: the wider range).
    The coarse points first (p = 1, min-max, among them), all at once, then each group's neighbourhood of its best
    one, all at once; the same choice as trying the points one by one (scale_search_reference). `rows`: the errors
    taken that many groups at a time (candidate_params), the rest over every group at once (few calls)."""
    xmin, xmax = w.amin(dim=-1), w.amax(dim=-1)
    coarse = torch.tensor(grid.coarse_shrinks(sym, imp is not None), dtype=w.dtype, device=w.device)  # [C], 1 first
    best_p, best_s, best_z, best_err = _pick(coarse, *candidate_params(w, imp, xmin, xmax, coarse, bits, sym, rows))
    if grid.coarse == 1:  # every grid point was coarse: nothing left to refine
        return best_s, best_z, best_err
    offsets = torch.tensor(grid.fine_offsets(), dtype=w.dtype, device=w.device)  # [F]
    fine = best_p.unsqueeze(-1) + offsets
    fine = torch.where(offsets > 0, fine.clamp(max=1.0), fine).clamp(min=1 - grid.shrink(sym, imp is not None))
    _, s, z, err = _pick(fine, *candidate_params(w, imp, xmin, xmax, fine, bits, sym, rows))
    better = err < best_err
    return torch.where(better, s, best_s), torch.where(better, z, best_z), torch.where(better, err, best_err)


def refine_params(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                  err: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2, one round: the codes of (scale, zero) fixed, the weighted least-squares fit of w ~ s * q + b
    (symmetric: b = -s * zero with the zero fixed at the middle code), rounded to the format (fp16 scale, integral
    zero); kept per group where its error is lower. Returns scale, zero, error [...]. Without importance the weights
    are 1 and left out (multiplying by 1 is exact: the same fit bit for bit)."""
    maxq = 2**bits - 1
    q = torch.div(w, scale.unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, maxq)
    tiny = torch.finfo(torch.float32).tiny
    if sym:
        c = q.sub_(zero.unsqueeze(-1))
        ac = c if imp is None else imp * c
        den = (ac * c).sum(-1)
        s = ac.mul_(w).sum(-1) / den.clamp(min=tiny)  # (a c) w: ac is not needed after
        z = zero
    else:
        n = w.shape[-1] if imp is None else imp.expand_as(w).sum(-1).clamp(min=tiny)
        qm = (q if imp is None else imp * q).sum(-1) / n
        wm = (w if imp is None else imp * w).sum(-1) / n
        qc = q.sub_(qm.unsqueeze(-1))
        aqc = qc if imp is None else imp * qc
        den = (aqc * qc).sum(-1)
        s = (aqc * (w - wm.unsqueeze(-1))).sum(-1) / den.clamp(min=tiny)
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
    where the error falls, down first: both tried at once ([..., 2, G]), which chooses as trying down, then up from
    the zero kept (after a step down, up is the old zero, not lower). Returns zero, error [...]."""
    maxq = 2**bits - 1
    z = torch.stack((zero - 1, zero + 1), -1).clamp_(0, maxq)  # [..., 2]
    e = group_error(w, imp, scale.unsqueeze(-1).expand_as(z), z, maxq)
    down, up = e[..., 0] < err, e[..., 1] < err
    pick = torch.where(down, 0, torch.where(up, 1, 2)).unsqueeze(-1)  # 2: keep
    zero = torch.cat((z, zero.unsqueeze(-1)), -1).gather(-1, pick).squeeze(-1)
    return zero, torch.cat((e, err.unsqueeze(-1)), -1).gather(-1, pick).squeeze(-1)


def search_params(w: torch.Tensor, bits: int, sym: bool, imp: torch.Tensor | None = None,
                  grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [...] of each group of w [..., G] (the grid, then the refinements); imp broadcastable to w
    (per input channel; None: the plain weight error). The same (scale, zero) convention as minmax_params."""
    return _search(w.float(), None if imp is None else _floored(imp.float()), bits, sym, grid)


def _search(w: torch.Tensor, imp: torch.Tensor | None, bits: int, sym: bool, grid: SearchGrid,
            grid_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """search_params on w [..., G] fp32 with its importance already floored; the grid's errors `grid_rows` groups
    at a time (w [R, G], imp [R, G] or None: the [rows, C, G] temporaries kept small), everything else over all the
    rows at once (the refinements' temporaries are only [R, G]: in small pieces they would pay torch's per-call
    overhead many times over)."""
    scale, zero, err = grid_params(w, imp, bits, sym, grid, grid_rows)
    for _ in range(grid.refine):
        if not sym:
            zero, err = shift_zeros(w, imp, scale, zero, err, bits)
        scale, zero, err = refine_params(w, imp, scale, zero, err, bits, sym)
    return scale, zero


def _floored(imp: torch.Tensor) -> torch.Tensor:
    """Importance with a floor (1e-6 of its mean): an input channel that never fired still counts a little, so the
    least-squares fits stay defined and its weights are not rounded arbitrarily."""
    return imp.clamp(min=float(imp.mean()) * 1e-6 + torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class _Weight:
    """One weight's groups as rows: w [N * groups, G] (a view), imp [groups, G] floored (row r's is imp[r % groups])."""

    w: torch.Tensor
    imp: torch.Tensor | None

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        imp = None if self.imp is None else self.imp[torch.arange(lo, hi) % len(self.imp)]
        return self.w[lo:hi].float(), imp


def _chunks(weights: list[_Weight], rows: int):
    """The weights' group rows laid end to end, `rows` at a time: (w [rows, G] fp32, imp [rows, G] or None)."""
    ws, imps, have = [], [], 0
    for weight in weights:
        lo = 0
        while lo < len(weight.w):
            hi = min(len(weight.w), lo + rows - have)
            w, imp = weight.rows(lo, hi)
            ws.append(w)
            imps.append(imp)
            have, lo = have + hi - lo, hi
            if have == rows:
                yield torch.cat(ws), None if imp is None else torch.cat(imps)
                ws, imps, have = [], [], 0
    if ws:
        yield torch.cat(ws), None if imps[0] is None else torch.cat(imps)


def search_weights_params(ws: list[torch.Tensor], scheme: QuantScheme, imps: list[torch.Tensor] | None = None,
                          grid: SearchGrid = SearchGrid()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """search_params over whole weights W [N, K] (groups of G along K; imps: one [K] per weight, or None) searched
    together: the groups of all the weights of one group length in one list of rows, cut into chunks that bound the
    temporaries (many small linears cost one chunk's calls, not one call each). Returns each weight's scales, zeros
    [num_groups, N], as QuantizedWeight holds them."""
    by_len: dict[int, list[int]] = {}
    for i, w in enumerate(ws):
        k = w.shape[1]
        if k % scheme.group_len(k):
            raise ValueError(f"in_features {k} is not a multiple of the group size {scheme.group_len(k)}")
        by_len.setdefault(scheme.group_len(k), []).append(i)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for g, idx in by_len.items():
        found = _search_rows([ws[i] for i in idx], None if imps is None else [imps[i] for i in idx], g, scheme, grid)
        out.update(zip(idx, found))
    return [out[i] for i in range(len(ws))]


def _search_rows(ws: list[torch.Tensor], imps: list[torch.Tensor] | None, g: int, scheme: QuantScheme,
                 grid: SearchGrid) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """search_weights_params for weights of one group length g."""
    weights = [_Weight(w.reshape(-1, g), None if imps is None else _floored(imps[i].float()).reshape(-1, g))
               for i, w in enumerate(ws)]
    widest = max(len(grid.coarse_shrinks(scheme.sym, imps is not None)), len(grid.fine_offsets()))  # tried at once
    grid_rows = max(1, CHUNK_ELEMENTS // (g * widest))
    rows = max(grid_rows, REFINE_ELEMENTS // g)
    found = [_search(w, imp, scheme.bits, scheme.sym, grid, grid_rows=grid_rows) for w, imp in _chunks(weights, rows)]
    scales, zeros = torch.cat([s for s, _ in found]), torch.cat([z for _, z in found])
    out, start = [], 0
    for w in ws:
        n, groups = w.shape[0], w.shape[1] // g
        out.append(tuple(t[start:start + n * groups].reshape(n, groups).T.contiguous() for t in (scales, zeros)))
        start += n * groups
    return out


def search_weight_params(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                         grid: SearchGrid = SearchGrid()) -> tuple[torch.Tensor, torch.Tensor]:
    """search_params over a whole weight W [N, K] (groups of G along K; imp [K] or None), in chunks that bound the
    memory. Returns scales, zeros [num_groups, N], as QuantizedWeight holds them."""
    return search_weights_params([w], scheme, None if imp is None else [imp], grid)[0]


def searched_quantize(w: torch.Tensor, scheme: QuantScheme, imp: torch.Tensor | None = None,
                      grid: SearchGrid = SearchGrid()) -> QuantizedWeight:
    """Round to nearest with searched group parameters: rtn_quantize's counterpart. w: [N, K] float."""
    return searched_quantize_many([w], scheme, None if imp is None else [imp], grid)[0]


def searched_quantize_many(ws: list[torch.Tensor], scheme: QuantScheme, imps: list[torch.Tensor] | None = None,
                           grid: SearchGrid = SearchGrid()) -> list[QuantizedWeight]:
    """searched_quantize of several weights (a layer's linears), their groups searched together."""
    found = search_weights_params(ws, scheme, imps, grid)
    return [_codes(w, scheme, scales, zeros) for w, (scales, zeros) in zip(ws, found)]


def _codes(w: torch.Tensor, scheme: QuantScheme, scales: torch.Tensor, zeros: torch.Tensor) -> QuantizedWeight:
    """w [N, K] rounded with its scales, zeros [groups, N]."""
    n, k = w.shape
    g = scheme.group_len(k)
    s, z = scales.T.unsqueeze(-1), zeros.T.unsqueeze(-1)  # [N, groups, 1]
    codes = torch.clamp(torch.round(w.float().reshape(n, k // g, g) / s) + z, 0, scheme.maxq)
    return QuantizedWeight(codes.reshape(n, k).to(torch.uint8), scales, zeros, default_g_idx(k, scheme, w.device),
                           scheme)
