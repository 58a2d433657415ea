"""GPTAQ (Li et al., ICML 2025: GPTQ with asymmetric calibration) as pure functions: the cross term of the float and
the quantized model's inputs, and the target weight that plain GPTQ (quantkit.quant.gptq) then solves for.
The layer loop's side (the float twin and its stream) is in quantkit.quant.gptq_layer."""

from __future__ import annotations

import torch

from quantkit.quant.gptq import damped_cholesky


def accumulate_cross(d: torch.Tensor, n: int, x_float: torch.Tensor, x_quant: torch.Tensor) -> torch.Tensor:
    """Running D = 2/n * sum (x - x~) x~^T [K, K] in d's dtype, the cross term of GPTAQ's objective ||W X - Q X~||^2:
    x [..., K] a linear's input in the float model, x~ the same token's in the quantized one. `n` counts the tokens
    before this batch (as accumulate_hessian's, called after this one with the same n)."""
    xq = x_quant.reshape(-1, x_quant.shape[-1]).to(d.dtype)
    dx = x_float.reshape(-1, x_float.shape[-1]).to(d.dtype) - xq
    m = xq.shape[0]
    return d.addmm_(dx.T, xq, beta=n / (n + m), alpha=2.0 / (n + m))


CROSS_COLUMNS = 2048  # columns of D per product W D in float64: a K x 2048 temporary (235 MB at K = 14336)


def asymmetric_target(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor, alpha: float, damp: float,
                      max_retries: int = 6, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """GPTAQ's target (Li et al., ICML 2025: asymmetric calibration) as a weight for plain GPTQ: W + alpha W D H^-1.

    With H = X~ X~^T and D = (X - X~) X~^T (the quantized model's inputs X~, the float model's X, both [K, tokens]),
    W X = W* X~ + W X (I - P), P the projection onto X~'s row space and W* = W X X~^T H^-1 = W + W D H^-1. The second
    term is orthogonal to every Q X~, so ||W X - Q X~||^2 = ||(W* - Q) X~||^2 + const: GPTQ on W* with H minimizes the
    asymmetric objective, the float model's outputs as the target. alpha in (0, 1] shrinks the correction (1: the
    exact objective; GPTAQ's reference code and GPTQModel use 0.25). w [N, K] fp32, returned as a new tensor.

    The two steps, cross_weight then target_from_cross, are public so that a caller done with D can let it go between
    them (the layer loop: D is a K x K fp32 matrix, 0.77 GiB at K = 14336, not to be held beside the factor)."""
    return target_from_cross(w, h, cross_weight(w, d, dtype), alpha, damp, max_retries, dtype)


def cross_weight(w: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(W D)^T [K, N] in `dtype` for w [N, K] and D [K, K], a block of D's columns at a time (no K x K copy of D in
    `dtype`; its rounding then does not move with the thread count, as the factor's does not)."""
    k = d.shape[0]
    wd = torch.empty(k, w.shape[0], dtype=dtype, device=w.device)
    w_wide = w.to(dtype)
    for j in range(0, k, CROSS_COLUMNS):
        wd[j:j + CROSS_COLUMNS] = (w_wide @ d[:, j:j + CROSS_COLUMNS].to(dtype)).T
    return wd


def target_from_cross(w: torch.Tensor, h: torch.Tensor, wd: torch.Tensor, alpha: float, damp: float,
                      max_retries: int = 6, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """W + alpha (H^-1 (W D)^T)^T from wd = cross_weight(w, d) [K, N]: H damped as GPTQ damps it
    (gptq.damped_cholesky: damp x mean(diag), raised x10 until it factors, a dead column's diagonal taken as 1), its
    factor in one K x K buffer of `dtype` (1.5 GiB at K = 14336 in float64). w [N, K] fp32, returned as a new
    tensor."""
    factor, _ = damped_cholesky(h, damp, max_retries, dtype)  # H + damp = L L^T, lower, column-major
    correction = torch.cholesky_solve(wd, factor)  # H^-1 (W D)^T, H symmetric
    del factor
    return torch.add(w, correction.T.to(w.dtype), alpha=alpha)
