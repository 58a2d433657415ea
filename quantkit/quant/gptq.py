"""GPTQ (Frantar et al., 2022) as small pure functions, after the IST-DASLab reference.

The Hessian of the layer-wise objective ||W X - W_hat X||^2 is H = 2 X X^T / n, accumulated
batch by batch in fp32. Its Cholesky factorizations run in float64 and are rounded to fp32 once:
LAPACK's blocked fp32 Cholesky gives different last bits at different thread counts, and GPTQ's
rounding decisions amplify them (the same windows gave different perplexities at 1 and 2 threads). Quantization walks the columns of W (optionally in act-order, largest
diag(H) first), quantizes one column, and spreads its error over the columns not yet quantized
through the Cholesky factor of H^-1; updates are applied lazily, `block_size` columns at a time. With static groups
the same updates are spread as residuals through H's own Cholesky factor (hessian_factor: Babai's nearest-plane form,
no inverse: half the work of a Cholesky and a triangular inverse).
With group-aware act-order (quantkit.quant.column_order) whole groups are walked by importance instead, and
each group's scale and zero are stored under its original index: g_idx stays monotonic.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from quantkit.config import SCALE_SEARCHES
from quantkit.format.primitives import QuantizedWeight, QuantScheme, minmax_params, quantize_codes
from quantkit.quant.column_order import group_aware_perm, walk_groups

log = logging.getLogger(__name__)

SUB_BLOCK = 16  # columns per inner lazy batch (see _quantize_columns)


def empty_hessian(in_features: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.zeros(in_features, in_features, dtype=torch.float32, device=device)


HESSIAN_COLUMN_BLOCKS = 8  # H's lower triangle in this many column blocks: (1 + 1/8) / 2 of X^T X's multiply-adds


def accumulate_hessian(h: torch.Tensor, n: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running H = 2/n * sum x x^T in h's dtype. x: [..., K] (any float dtype); returns (H, new n).

    H is symmetric, so only its lower triangle is multiplied out, one column block at a time
    (each block from the diagonal down, one GEMM each), then mirrored block by block: about 56% of X^T X's
    work, and no K x K temporary."""
    x = x.reshape(-1, x.shape[-1]).to(h.dtype)
    m, k = x.shape
    step = -(-k // HESSIAN_COLUMN_BLOCKS)
    for i in range(0, k, step):
        h[i:, i:i + step].addmm_(x[:, i:].T, x[:, i:i + step], beta=n / (n + m), alpha=2.0 / (n + m))
    mirror_lower(h, step)
    return h, n + m


def mirror_lower(h: torch.Tensor, step: int) -> None:
    """h [K, K] made symmetric in place from its lower triangle, diagonal blocks of `step` at a time: the same numbers
    as h.tril() + h.tril(-1).T, with temporaries of a diagonal block's size, where that form makes three of K x K
    (2.3 GiB at K = 14336, an 8B model's down_proj, on every calibration batch)."""
    k = h.shape[0]
    for i in range(0, k, step):
        j = min(i + step, k)
        h[i:j, j:].copy_(h[j:, i:j].T)  # the strict upper triangle right of the block, from below it
        block = h[i:j, i:j]
        block.copy_(block.tril() + block.tril(-1).T)


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = 0.01  # fraction of mean(diag(H)) added to the diagonal
    block_size: int = 128
    act_order: bool = False
    # GAR: whole groups by decreasing max diag(H), each group's columns by decreasing diag(H); g_idx stays monotonic
    act_group_aware: bool = False
    static_groups: bool = False
    max_damp_retries: int = 6
    # each group's scale and zero: min-max, or searched (quantkit.quant.scale_search) on the weight error (mse) or
    # on the error weighted by diag(H), the inputs' mean square per channel (imatrix)
    scale_search: str = "minmax"
    # the working precision of the inverse Hessian's factor (the result is fp32 either way)
    factor_dtype: torch.dtype = torch.float64

    def __post_init__(self):
        if self.act_order and self.act_group_aware:
            raise ValueError("GPTQ: act_order and act_group_aware are two column orders; choose one")


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    row_losses: torch.Tensor  # [N] fp32: GPTQ's objective per output row, ||(W - Q) / diag(U)||^2 / 2
    damp: float  # the damping fraction finally used

    @property
    def loss(self) -> float:
        return float(self.row_losses.sum())


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """The row blocks of sizes[0], sizes[1], ... of a weight quantized as one (linears sharing an
    input are quantized stacked: GPTQ treats rows independently given H)."""
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        out.append(QuantizedWeight(qw.qweight[rows], qw.scales[:, rows], qw.zeros[:, rows], qw.g_idx, qw.scheme))
        start += n
    return out


REVERSE_ROWS = 64  # rows per chunk when a K x K matrix is reversed into another: a chunk-sized temporary
TRI_INV_LEAF = 128  # a lower-triangular block this small is inverted by one solve against the identity
TRI_INV_STRIP = 2048  # rows / columns per triangular solve on an off-diagonal block: a strip-sized temporary


def hessian_factor(h: torch.Tensor, damp: float, max_retries: int, out: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, float]:
    """What GPTQ's column loop needs of H, from one Cholesky and no inverse: P [K, K] upper, in H's dtype, with
    P_ii = 1 / R_ii and P_ji = -R_ji / R_ii (j < i), where H + damp*mean(diag H)*I = R R^T, R upper; damp raised
    x10 until it factors. With U = R^-1 (the upper factor of H^-1 that GPTQ is written with, U^T U = H^-1), the
    loop's errors E = (W - Q) R, so column i's updated value is w_i + sum_{j<i} (w_j - q_j) R_ji / R_ii: the same
    numbers (but for float rounding) as w_i - sum_{j<i} E_j U_ji, without forming U (Babai's nearest-plane form of
    GPTQ). P_ii = U_ii, so the objective E_i = (x_i - q_i) / P_ii is GPTQ's.

    With J the reversal permutation, J H J = L L^T (one potrf, K^3/3 flops) gives R = J L J. `out` [K, K] of H's
    dtype receives P; it may be h itself, read only until the factor succeeds. In float64 by default, returned in H's
    dtype (see inverse_hessian_cholesky on thread counts); the work lives in one K x K buffer of `dtype`."""
    a, damp = damped_cholesky(h, damp, max_retries, dtype, reverse=True)  # L, lower, column-major
    d = a.diagonal().clone()
    a.div_(d.neg())  # column b of L over -L_bb
    a.diagonal().copy_(d.reciprocal())
    p = torch.empty_like(h) if out is None else out
    _reverse_into(p, a)  # P = J (scaled L) J, upper (h is no longer read)
    return p, damp


def inverse_hessian_cholesky(h: torch.Tensor, damp: float, max_retries: int, out: torch.Tensor | None = None,
                             dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, float]:
    """Upper U with U^T U = (H + damp*mean(diag H)*I)^-1, raising damp x10 until it factors: the factor GPTQ is
    written with (the textbook loop the tests hold the column loop to; gptq_quantize needs only hessian_factor).
    `out` [K, K] of H's dtype receives U; it may be h itself, which is read only until the factor succeeds.

    With J the reversal permutation, J H J = L L^T (one potrf) gives H = R R^T with R = J L J upper, so
    U = R^-1 = J L^-1 J: one Cholesky and one triangular inverse, about 2/3 K^3 flops, where the chain
    cholesky, cholesky_inverse, cholesky (upper) takes 4/3 K^3. In float64, returned in H's dtype: MKL's potrf
    differs in its last float64 bits between thread counts, as the chain does, and rounding hides nearly all of it
    (K = 4096: 4 of 16.7M fp32 entries differ between 1 and 2 threads, the chain's 5; no GPTQ code changes); in
    fp32 about half of them differ. The work lives in one K x K buffer of `dtype` and strip-sized temporaries."""
    a, damp = damped_cholesky(h, damp, max_retries, dtype, reverse=True)
    invert_lower_in_place(a)  # a = L^-1
    u = torch.empty_like(h) if out is None else out
    _reverse_into(u, a)  # U = J L^-1 J, upper (h is no longer read)
    return u, damp


def damped_cholesky(h: torch.Tensor, damp: float, max_retries: int, dtype: torch.dtype, reverse: bool = False,
                    ) -> tuple[torch.Tensor, float]:
    """L [K, K] lower (a column-major view of a new buffer in `dtype`, upper triangle zero) with
    A + damp*mean(diag A)*I = L L^T, A = H, or J H J (rows and columns reversed) with `reverse`; damp raised x10 until
    it factors, returned with L. A zero on H's diagonal (an input that never fired) counts as 1. h is only read.
    GPTQ's factors (reversed) and GPTAQ's target (quantkit.quant.gptaq) both start here."""
    k = h.shape[0]
    diag = h.diagonal().to(torch.float64)
    diag = diag.flip(0) if reverse else diag
    diag = torch.where(diag == 0, 1.0, diag)
    mean_diag = torch.mean(diag)
    info = torch.empty((), dtype=torch.int32, device=h.device)
    buf = torch.empty(k, k, dtype=dtype, device=h.device)
    for attempt in range(max_retries + 1):
        if reverse:
            _reverse_into(buf, h)  # J H J, symmetric
        else:
            buf.copy_(h)
        a = buf.mT  # column-major, the layout LAPACK works on, so no call copies it
        a.diagonal().copy_(diag + damp * mean_diag)
        torch.linalg.cholesky_ex(a, out=(a, info))  # a = L, lower (upper triangle zeroed)
        if info == 0:
            return a, damp
        log.warning("Cholesky failed at damp=%g (attempt %d); retrying with %g", damp, attempt + 1, damp * 10)
        damp *= 10
    raise ArithmeticError(f"Hessian not positive definite even with damp={damp / 10:g}")


def _reverse_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = J src J (rows and columns reversed) [K, K], converted to dst's dtype, `REVERSE_ROWS` rows at a time."""
    k = src.shape[0]
    for i in range(0, k, REVERSE_ROWS):
        j = min(i + REVERSE_ROWS, k)
        dst[i:j].copy_(src[k - j : k - i].flip(0, 1))


def invert_lower_in_place(t: torch.Tensor) -> None:
    """t [K, K] lower triangular (zero above the diagonal) becomes t^-1, by recursive halving (torch has no trtri):

        [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]

    The off-diagonal block is two triangular solves with A and C, taken before they are inverted in turn: K^3/3
    flops in all, as LAPACK's trtri, where a solve against the identity takes K^3. Each solve runs on a strip of
    rows (B A^-1: row by row) or of columns (C^-1 Z: column by column), so no temporary is a quarter of t."""
    k = t.shape[0]
    if k <= TRI_INV_LEAF:
        eye = torch.eye(k, dtype=t.dtype, device=t.device)
        t.copy_(torch.linalg.solve_triangular(t, eye, upper=False))
        return
    m = k // 2
    a, b, c = t[:m, :m], t[m:, :m], t[m:, m:]
    for r in range(0, k - m, TRI_INV_STRIP):
        rows = b[r : r + TRI_INV_STRIP]  # B A^-1 = (A^-T B^T)^T: a left solve, which reads A in place (a right
        rows.copy_(torch.linalg.solve_triangular(a.mT, rows.mT, upper=True).mT)  # solve would copy it)
    for q in range(0, m, TRI_INV_STRIP):
        cols = b[:, q : q + TRI_INV_STRIP]
        cols.copy_(torch.linalg.solve_triangular(c, cols, upper=False)).neg_()  # -C^-1 (B A^-1)
    invert_lower_in_place(a)
    invert_lower_in_place(c)


def group_params_fn(scheme: QuantScheme, search: str, diag: torch.Tensor):
    """params(w_cols [N, L], start) -> scale, zero [N] of the group of columns start .. start + L (in the order
    `diag` [K], H's diagonal, is given): min-max, or searched, weighted by diag where the search measures the inputs
    (`imatrix`)."""
    kind = SCALE_SEARCHES[search]
    if not kind.searched:
        return lambda w_cols, start: minmax_params(w_cols, scheme.bits, scheme.sym)
    from quantkit.quant.scale_search import search_params

    def params(w_cols: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        imp = diag[start:start + w_cols.shape[1]] if kind.measures_inputs else None
        return search_params(w_cols, scheme.bits, scheme.sym, imp)
    return params


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, opts: GPTQOptions,
                  consume_h: bool = False, consume_w: bool = False) -> GPTQResult:
    """Quantize W [N, K] against Hessian H [K, K]. Returns codes in the original column order. `consume_h`: the
    caller is done with H, whose storage then receives the inverse Hessian's factor (else H stays as it is).
    `consume_w`: the caller is done with W, which is then worked on in place, not copied (an fp32 W [N, K]: 0.47 GB
    at an 8B model's gate|up), and may be changed."""
    w = _own_fp32(w, consume_w)
    given = h
    h = h.detach().float()  # not copied unless a dead column must be patched or H is not fp32
    n, k = w.shape
    gsize = scheme.group_len(k)
    dead = torch.diag(h) == 0
    if dead.any():
        h = h.clone()
        h[dead, dead] = 1
    w[:, dead] = 0

    num_groups = (k + gsize - 1) // gsize
    scales = torch.zeros(num_groups, n, device=w.device)  # [groups, N], filled as groups are reached
    zeros = torch.zeros_like(scales)
    static = None
    if opts.static_groups:  # group parameters from the original column groups, before act-order
        params = group_params_fn(scheme, opts.scale_search, torch.diag(h))
        static = [params(w[:, s : s + gsize], s) for s in range(0, k, gsize)]
        for j, (scale, zero) in enumerate(static):
            scales[j], zeros[j] = scale, zero

    perm = torch.arange(k, device=w.device)
    if opts.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
    elif opts.act_group_aware:
        perm = group_aware_perm(torch.diag(h), gsize)
    if opts.act_order or opts.act_group_aware:
        w, h = w[:, perm], h[perm][:, perm]
    params = group_params_fn(scheme, opts.scale_search, torch.diag(h).clone())  # permuted order, undamped
    own = consume_h or h.data_ptr() != given.data_ptr()  # H handed over, or a copy made here
    del given
    # Babai's form (no inverse) unless a group's scale is taken from columns the loop has updated: its intermediate
    # updates are not the textbook's, only each column's final value is
    residual_form = static is not None or gsize >= k
    factor = hessian_factor if residual_form else inverse_hessian_cholesky
    p, damp = factor(h, opts.damp, opts.max_damp_retries, out=h if own else None, dtype=opts.factor_dtype)
    del h

    # The loop runs on W^T [K, N]: a column of W is then a contiguous row, which on CPU makes the
    # per-column quantize and the rank-1 updates several times faster than strided columns.
    wt = w.T.contiguous()
    del w
    codes, row_losses = _quantize_columns(wt, p, scheme, opts.block_size, static, perm, scales, zeros, params,
                                          residual_form)
    by_original_group = static is not None
    if opts.act_group_aware and not by_original_group:  # group j of the walk is original group walk_groups[j]
        order = walk_groups(perm, gsize)
        scales[order], zeros[order] = scales.clone(), zeros.clone()
        by_original_group = True
    return GPTQResult(_to_quantized_weight(codes, scales, zeros, perm, scheme, by_original_group), row_losses, damp)


def _own_fp32(t: torch.Tensor, consume: bool) -> torch.Tensor:
    """t in fp32 for this function to change: t itself if the caller handed it over (`consume`), else a copy."""
    f = t.detach().float()
    return f if consume or f.data_ptr() != t.data_ptr() else f.clone()


def _quantize_columns(wt: torch.Tensor, p: torch.Tensor, scheme: QuantScheme, block_size: int,
                      static: list | None, perm: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, params, residual_form: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's lazy-batch loop over W^T [K, N] (updated in place), permuted column order. Fills `scales`/`zeros`
    [groups, N] for groups found on the way (static groups come filled). Returns the codes [K, N] and the objective
    per row [N]. Column i (a row of W^T) is quantized at x_i, one of two forms of the same value:

    - the textbook's, P = U [K, K] (inverse_hessian_cholesky): x_i = w_i - sum_{j<i} E_j U_ji, E_j GPTQ's scaled
      error (x_j - deq(q_j)) / U_jj;
    - with `residual_form`, P = hessian_factor's: x_i = w_i - sum_{j<i} d_j P_ji, d_j = w_j - deq(q_j) against the
      original w_j (a copy of W^T is kept for them). Midway (j < s < i) the sums differ from the textbook's, so a
      group's scale must not be taken from the updated columns (static groups, or one group).

    The updates are lazy at two levels, so no per-column step touches more than a few rows: a row of W^T gets the
    updates of the earlier columns of its sub-block (`SUB_BLOCK` columns) as one vector-matrix product just before
    it is quantized; each finished sub-block updates the rest of its block, and each finished block the rest of
    W^T, as one GEMM. `params(w_cols, start)` gives a group's scale and zero when the loop reaches it
    (group_params_fn)."""
    k, n = wt.shape
    gsize = scheme.group_len(k)
    sub = math.gcd(SUB_BLOCK, gsize)  # group starts fall on sub-block starts, with every earlier error applied
    original = wt.clone() if residual_form else None  # [K, N]: the residuals d are taken against these
    codes = torch.empty_like(wt)
    losses = torch.zeros(n, dtype=torch.float32, device=wt.device)
    diag = p.diagonal().tolist()  # Python floats: no 0-d tensor per column
    scale = zero = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = wt[i1:i2].clone()  # [B, N]
        err1 = torch.empty_like(w1)  # GPTQ's scaled errors E
        upd1 = torch.empty_like(w1) if residual_form else err1  # what the updates spread: d, or E
        p1 = p[i1:i2, i1:i2]
        for s1 in range(0, i2 - i1, sub):
            s2 = min(s1 + sub, i2 - i1)
            for i in range(s1, s2):
                col = i1 + i
                if static is not None:
                    scale, zero = static[int(perm[col]) // gsize]
                elif col % gsize == 0:
                    scale, zero = params(_group_rows(wt, w1, i1, i, gsize).T, col)
                    scales[col // gsize], zeros[col // gsize] = scale, zero
                x = w1[i] if i == s1 else torch.addmv(w1[i], upd1[s1:i].T, p1[s1:i, i], alpha=-1)  # [N]
                _quantize_row(x, scale, zero, scheme.maxq, diag[col], codes[col], err1[i])
                if residual_form:
                    _residual(x, original[col], err1[i], diag[col], upd1[i])
            if s2 < i2 - i1:
                w1[s2:].addmm_(p1[s1:s2, s2:].T, upd1[s1:s2], alpha=-1)  # [B - s2, S] @ [S, N], in place
        losses += err1.square().sum(0) / 2
        # [K - i2, B] @ [B, N] in place: the same bits as `-= ... @ ...` without a [K - i2, N] temporary (235 MB
        # at an 8B down_proj's first block), 2-3x faster
        wt[i2:].addmm_(p[i1:i2, i2:].T, upd1, alpha=-1)
    return codes, losses


def _group_rows(wt: torch.Tensor, w1: torch.Tensor, i1: int, i: int, gsize: int) -> torch.Tensor:
    """The rows of W^T [gsize, N] of the group starting at row i1 + i, with every earlier error applied.

    A group starts a sub-block, so w1 (the block) holds its rows up to date. A group longer than
    the block (group size -1 with K > block_size) starts at row 0, before any error exists: its
    rows past the block are still wt's, as in the reference, which takes them from the whole W."""
    if i + gsize <= w1.shape[0]:
        return w1[i : i + gsize]
    return torch.cat([w1[i:], wt[i1 + w1.shape[0] : i1 + i + gsize]])


def _quantize_row(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, d: float,
                  q_out: torch.Tensor, err_out: torch.Tensor) -> None:
    """Codes of one row of W^T x [N] into q_out, and GPTQ's scaled error (x - dequant) / d into err_out.
    The same arithmetic as quantize_codes / dequantize_codes, written in place."""
    torch.div(x, scale, out=q_out).round_().add_(zero).clamp_(0, maxq)
    torch.sub(q_out, zero, out=err_out).mul_(scale)
    torch.sub(x, err_out, out=err_out).div_(d)


def _residual(x: torch.Tensor, w: torch.Tensor, err: torch.Tensor, d: float, res_out: torch.Tensor) -> None:
    """The residual w - dequant [N] of a row quantized at x (originally w), from its scaled error (x - dequant) / d."""
    torch.mul(err, d, out=res_out).sub_(x).add_(w)


def _to_quantized_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor,
                         scheme: QuantScheme, static: bool) -> QuantizedWeight:
    """The codes [N, K] uint8 in the original column order, from the loop's codes [K, N] fp32 in the permuted order,
    and each input column's group (g_idx). The codes are made bytes first (exact: they lie in [0, maxq]), so the
    permutation and the transpose move a quarter of the bytes.

    Without static groups, group j is the j-th run of `group_size` permuted columns (act-order
    makes g_idx non-monotonic); with static groups it is the original column group.
    """
    k = codes.shape[0]
    gsize = scheme.group_len(k)
    invperm = torch.argsort(perm)
    pos = torch.arange(k, device=codes.device)
    group_of_pos = pos // gsize if not static else perm // gsize  # group of each permuted position
    g_idx = group_of_pos[invperm].to(torch.int32)
    return QuantizedWeight(codes.to(torch.uint8)[invperm].T.contiguous(), scales, zeros, g_idx, scheme)
