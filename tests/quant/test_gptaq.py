"""GPTAQ's target against least squares, and GPTQ on it against GPTQ on the weights (the asymmetric error)."""

import pytest
import torch

from quantkit.format.primitives import QuantScheme
from quantkit.quant.gptaq import accumulate_cross, asymmetric_target
from quantkit.quant.gptq import GPTQOptions, accumulate_hessian, empty_hessian, gptq_quantize


def correlated_inputs(k: int, tokens: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, k, generator=g) @ torch.randn(k, k, generator=g) * 0.2


# GPTAQ: asymmetric calibration (the float model's inputs X, the quantized model's X~ = X + error)

def paired_statistics(x_float: torch.Tensor, x_quant: torch.Tensor, chunk: int = 100):
    """(H, D) of the quantized inputs and the float ones, accumulated in chunks as the layer loop does."""
    k = x_quant.shape[1]
    h, d, n = empty_hessian(k), empty_hessian(k), 0
    for xf, xq in zip(x_float.split(chunk), x_quant.split(chunk)):
        accumulate_cross(d, n, xf, xq)
        h, n = accumulate_hessian(h, n, xq)
    return h, d


def drifted_inputs(k: int, tokens: int = 1024, drift: float = 0.3):
    """X and X~ = X plus an error correlated with X (as a quantized model's drift is)."""
    x = correlated_inputs(k, tokens)
    g = torch.Generator().manual_seed(5)
    return x, x + drift * (x @ torch.randn(k, k, generator=g) / k ** 0.5)


def asymmetric_error(x_float, x_quant, w, w_hat) -> float:
    return float(((x_float @ w.T - x_quant @ w_hat.T) ** 2).mean())


def test_the_cross_term_accumulates_as_its_batch_formula():
    x, xq = drifted_inputs(32, 300)
    h, d = paired_statistics(x, xq)
    assert torch.allclose(d, 2 * (x - xq).T @ xq / x.shape[0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(h, 2 * xq.T @ xq / x.shape[0], rtol=1e-4, atol=1e-4)


def test_the_asymmetric_target_is_the_least_squares_fit_of_the_float_outputs():
    """alpha 1, no damping to speak of: W* = argmin_V ||W X - V X~||^2, as lstsq finds it."""
    x, xq = drifted_inputs(48, 600)
    w = torch.randn(20, 48, generator=torch.Generator().manual_seed(2))
    h, d = paired_statistics(x, xq)
    target = asymmetric_target(w, h, d, alpha=1.0, damp=1e-10)
    fit = torch.linalg.lstsq(xq.double(), (x @ w.T).double()).solution.T.float()
    assert torch.allclose(target, fit, rtol=1e-3, atol=1e-3)
    assert asymmetric_error(x, xq, w, target) < 0.01 * asymmetric_error(x, xq, w, w)


def test_alpha_scales_the_correction_and_no_drift_leaves_the_weights():
    x, xq = drifted_inputs(32, 300)
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    h, d = paired_statistics(x, xq)
    full, quarter = (asymmetric_target(w, h, d, alpha, 0.01) for alpha in (1.0, 0.25))
    assert torch.allclose(quarter - w, 0.25 * (full - w), rtol=1e-5, atol=1e-6)
    h0, d0 = paired_statistics(xq, xq)  # the same inputs in both models: D = 0, W* = W to the bit
    assert torch.equal(d0, torch.zeros_like(d0))
    assert torch.equal(asymmetric_target(w, h0, d0, 1.0, 0.01), w)


def test_dead_inputs_leave_a_finite_target():
    x, xq = drifted_inputs(32, 300)
    x[:, 5] = xq[:, 5] = 0
    h, d = paired_statistics(x, xq)
    target = asymmetric_target(torch.randn(8, 32), h, d, 1.0, 0.01)
    assert torch.isfinite(target).all()


@pytest.mark.parametrize("static", [False, True])
def test_gptq_on_the_asymmetric_target_fits_the_float_outputs_better(static):
    """GPTQ on W* (GPTAQ) against GPTQ on W, both with the quantized inputs' Hessian: the error against the float
    model's outputs, ||W X - Q X~||^2, is lower with the target; alpha 1 lower than alpha 0.25."""
    x, xq = drifted_inputs(128)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    h, d = paired_statistics(x, xq)
    scheme, opts = QuantScheme(4, 32, True), GPTQOptions(static_groups=static)
    errors = {}
    for alpha in (None, 0.25, 1.0):
        target = w if alpha is None else asymmetric_target(w, h, d, alpha, opts.damp)
        errors[alpha] = asymmetric_error(x, xq, w, gptq_quantize(target, h, scheme, opts).weight.dequantize())
    assert errors[1.0] < errors[0.25] < errors[None]
    assert errors[1.0] < 0.5 * errors[None]


def test_an_asymmetric_target_whose_hessian_never_factors_raises():
    with pytest.raises(ArithmeticError, match="not positive definite"):
        asymmetric_target(torch.randn(4, 8), -torch.eye(8), torch.zeros(8, 8), 1.0, 0.01, max_retries=2)


def test_an_indefinite_hessian_is_damped_until_it_factors(caplog):
    """The target's factor raises the damping x10 as GPTQ's does (the same gptq.damped_cholesky): an H that fails at
    the first damping still gives a finite target, and the retry is logged."""
    h = -torch.eye(8)
    h[0, 0] = 40.0  # mean diagonal > 0, indefinite until the damping passes 1
    target = asymmetric_target(torch.randn(4, 8), h, torch.randn(8, 8), 1.0, 0.01)
    assert torch.isfinite(target).all()
    assert "Cholesky failed" in caplog.text
