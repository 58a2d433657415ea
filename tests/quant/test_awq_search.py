"""AWQ's pure math: fake quantization, candidate scales, the ratio grid, the clip search."""

from __future__ import annotations

import pytest
import torch

from quantkit.quant.awq_search import (
    act_mean, candidate_scale, duo_ratio_grid, input_gram, linear_output_mse, output_error, clip_sample, clip_weight, fake_quantize, ratio_grid, scaled_fake_weight,
    group_error, scale_candidates, search_clip, search_scale, weight_mean,
)
from quantkit.format.primitives import QuantScheme, rtn_quantize


@pytest.mark.parametrize("slice_rows", [2048, 5])  # the in-place slices: one for the whole weight, or many
@pytest.mark.parametrize("group_size,sym", [(32, False), (64, True), (-1, False)])
def test_fake_quantize_matches_rtn_bit_for_bit(group_size, sym, slice_rows, monkeypatch):
    import quantkit.quant.awq_search as awq_search

    monkeypatch.setattr(awq_search, "FAKE_QUANT_ROWS", slice_rows)
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.rand(1, 128) * 3
    kept = w.clone()
    scheme = QuantScheme(4, group_size, sym)
    assert torch.equal(fake_quantize(w, scheme), rtn_quantize(w, scheme).dequantize())
    assert torch.equal(fake_quantize(w.T.contiguous().T, scheme), rtn_quantize(w, scheme).dequantize())
    assert torch.equal(w, kept)  # in place on a copy only


def test_ratio_grid_is_twenty_points_in_unit_interval():
    grid = ratio_grid(20)
    assert len(grid) == 20 and grid[0] == 0.0 and max(grid) < 1.0
    assert grid == sorted(grid)


def test_candidate_scale_is_normalized_and_follows_activations():
    x_mean = torch.tensor([0.01, 0.1, 1.0, 10.0])
    assert torch.allclose(candidate_scale(x_mean, None, 0.0), torch.ones(4))
    s = candidate_scale(x_mean, None, 0.5)
    assert torch.allclose(s.max() * s.min(), torch.tensor(1.0))
    assert torch.all(s[1:] > s[:-1])  # larger activations get larger scales
    duo = candidate_scale(x_mean, torch.tensor([1.0, 1.0, 1.0, 0.1]), 0.5)
    assert duo[3] / duo[2] > s[3] / s[2]  # duo scaling also boosts channels with small weights


def test_act_and_weight_means():
    xs = [torch.tensor([[[1.0, -2.0]]]), torch.tensor([[[-3.0, 4.0], [1.0, 0.0]]])]
    assert torch.allclose(act_mean(xs), torch.tensor([5 / 3, 2.0]))
    w = torch.tensor([[1.0, -2.0, 4.0, 4.0]])
    assert torch.allclose(weight_mean([w], QuantScheme(4, 2, False)), torch.tensor([0.5, 1.0, 1.0, 1.0]))


def test_scaled_fake_weight_is_float_exact_without_quantization_error():
    # with 8 bits and a tiny weight range the fold round trip W*s/s is the only error
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    s = torch.rand(64) + 0.5
    got = scaled_fake_weight(w, s, QuantScheme(8, 32, False))
    assert torch.allclose(got, w, atol=0.05)


def test_search_scale_picks_the_lowest_loss():
    x_mean = torch.tensor([1.0, 4.0])
    target = candidate_scale(x_mean, None, 0.35)
    choice = search_scale(scale_candidates(x_mean, None, 20, "false"), lambda s: float((s - target).abs().sum()))
    assert choice.best.ratio == 0.35 and not choice.best.duo and choice.loss == min(choice.losses)
    assert torch.equal(choice.best.scale, target)
    with pytest.raises(RuntimeError):
        search_scale(scale_candidates(x_mean, None, 4, "false"), lambda s: float("nan"))


def test_duo_scaling_tries_the_identity_first():
    """No duo grid point is the identity (ratio 0 gives 1 / w_mean), so it is a candidate of its own:
    a group whose loss is lowest unscaled stays unscaled."""
    x_mean, w_mean = torch.tensor([1.0, 4.0, 2.0]), torch.tensor([0.5, 1.0, 0.25])
    assert not torch.allclose(candidate_scale(x_mean, w_mean, 0.0), torch.ones(3))
    choice = search_scale(scale_candidates(x_mean, w_mean, 20, "true"), lambda s: float((s - 1).abs().sum()))
    assert len(choice.losses) == 20 and choice.losses[0] == choice.loss == 0.0 and choice.best.ratio == 0.0
    assert torch.equal(choice.best.scale, torch.ones(3)) and not choice.best.duo
    assert duo_ratio_grid(20) == [i / 18 for i in range(19)]  # 0 to 1 inclusive: 19 points and the identity
    plain = scale_candidates(x_mean, None, 20, "false")
    assert len(plain) == 20 and torch.equal(plain[0].scale, torch.ones(3))  # ratio 0 is the identity already
    both = scale_candidates(x_mean, w_mean, 20, "both")
    assert len(both) == 39 and [c.duo for c in both] == [False] * 20 + [True] * 19  # the identity once
    with pytest.raises(ValueError, match="needs the weight statistic"):
        scale_candidates(x_mean, None, 20, "both")


def _synthetic_group(seed: int, heavy: bool):
    """A smoothing group of two linears [48 + 32, 128] on inputs with a few outlier channels: its candidates'
    statistics and loss_of(s), the linears' output MSE with weights Q(W s) / s (asymmetric g32)."""
    g = torch.Generator().manual_seed(seed)
    k = 128
    x = torch.randn(256, k, generator=g) * torch.exp(torch.randn(k, generator=g) * (1.5 if heavy else 0.5))
    ws = [torch.randn(48, k, generator=g), torch.randn(32, k, generator=g) * torch.rand(k, generator=g)]
    if heavy:
        ws = [w * torch.distributions.StudentT(3.0).sample(w.shape) for w in ws]
    scheme = QuantScheme(4, 32, False)
    gram, tokens = input_gram([x])
    w = torch.cat(ws)

    def loss_of(s):
        return linear_output_mse(scaled_fake_weight(w, s, scheme) - w, gram, tokens)
    return act_mean([x]), weight_mean(ws, scheme), loss_of


@pytest.mark.parametrize("heavy", [False, True])
def test_both_formulas_never_lose_to_either_alone(heavy):
    """duo_scaling "both": on every group its loss is at most the lower of "false"'s and "true"'s, and it keeps
    the formula that won (over these groups, each formula wins somewhere: "both" is not one of them in disguise)."""
    torch.manual_seed(0)
    winners = set()
    for seed in range(8):
        x_mean, w_mean, loss_of = _synthetic_group(seed, heavy)
        loss = {mode: search_scale(scale_candidates(x_mean, w_mean, 20, mode), loss_of) for mode in ("false", "true", "both")}
        assert loss["both"].loss <= min(loss["false"].loss, loss["true"].loss)
        assert loss["both"].loss == min(loss["false"].loss, loss["true"].loss)
        winner = min(("false", "true"), key=lambda m: loss[m].loss)
        assert loss["both"].best.duo == (winner == "true" and loss["true"].best.duo)
        winners.add(loss["both"].best.duo)
    assert winners == {False, True}, winners


def test_a_linears_output_error_from_its_inputs_gram_matrix_equals_running_the_tokens():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 50, 48, generator=g) * torch.linspace(0.1, 5, 48), torch.randn(1, 30, 48, generator=g)]
    w = torch.randn(24, 48, generator=g)
    delta = fake_quantize(w, QuantScheme(4, 16, False)) - w
    gram, tokens = input_gram(xs)
    x = torch.cat([t.reshape(-1, 48) for t in xs])
    assert tokens == 130
    direct = float(((x @ (w + delta).T - x @ w.T) ** 2).mean())
    assert linear_output_mse(delta, gram, tokens) == pytest.approx(direct, rel=1e-4)


@pytest.mark.parametrize("k", [48, 200])
def test_a_linears_output_error_is_the_same_by_gram_or_by_tokens(k):
    """130 tokens: through the Gram matrix at K = 48 (more tokens than features), on the tokens at K = 200; either
    way the mean squared output change of running the tokens."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 50, k, generator=g) * torch.linspace(0.1, 5, k), torch.randn(1, 30, k, generator=g)]
    w = torch.randn(24, k, generator=g)
    delta = fake_quantize(w, QuantScheme(4, 8, False)) - w
    x = torch.cat([t.reshape(-1, k) for t in xs])
    direct = float(((x @ (w + delta).T - x @ w.T) ** 2).mean())
    assert output_error(xs)(delta) == pytest.approx(direct, rel=1e-4)
    gram, tokens = input_gram(xs)
    assert linear_output_mse(delta, gram, tokens) == pytest.approx(direct, rel=1e-4)


def test_clip_sample_strides_over_all_samples():
    xs = [torch.arange(6.0).view(1, 3, 2), torch.arange(6.0, 12.0).view(1, 3, 2)]
    got = clip_sample(xs, max_tokens=3)
    assert got.shape == (3, 2) and torch.equal(got[:, 0], torch.tensor([0.0, 4.0, 8.0]))


def _group_errors(w, q, x, g):
    n, k = w.shape
    xg = x.view(-1, k // g, g)
    return (torch.einsum("tjc,njc->ntj", xg, (q - w).view(n, k // g, g))).pow(2).mean(dim=1)


def test_clip_search_never_worse_than_no_clip_and_cuts_outliers():
    torch.manual_seed(2)
    scheme = QuantScheme(4, 32, False)
    w = torch.randn(16, 64) * 0.1
    w[3, 5] = 4.0  # an outlier weight on an input channel that carries almost nothing
    x = torch.randn(256, 64)
    x[:, 5] *= 1e-3
    max_val = search_clip(w, x, scheme, 20)
    org_max = w.abs().view(16, 2, 32).amax(-1)
    assert max_val.shape == (16, 2) and torch.all(max_val <= org_max)
    assert max_val[3, 0] < 0.6 * org_max[3, 0]  # the outlier group is clipped hard
    clipped = fake_quantize(clip_weight(w, max_val), scheme)
    plain = fake_quantize(w, scheme)
    assert torch.all(_group_errors(w, clipped, x, 32) <= _group_errors(w, plain, x, 32) + 1e-9)


@pytest.mark.parametrize("tokens", [96, 16])  # more tokens than the group's 32 columns: by the Gram matrix; fewer
def test_a_groups_clip_error_by_the_gram_matrix_is_its_partial_outputs_error(tokens):
    torch.manual_seed(4)
    x, d = torch.randn(tokens, 2, 32), torch.randn(8, 2, 32) * 0.01
    error, _ = group_error(x)
    want = torch.einsum("tjc,njc->ntj", x, d).pow(2).mean(dim=1)  # [n, G]: each group's partial outputs
    torch.testing.assert_close(error(d), want, rtol=1e-5, atol=0)


def test_clip_search_batches_rows_without_changing_the_answer(monkeypatch):
    import quantkit.quant.awq_search as awq_search

    torch.manual_seed(3)
    w, x = torch.randn(24, 64), torch.randn(64, 64)
    scheme = QuantScheme(4, 32, False)
    whole = search_clip(w, x, scheme, 20)
    monkeypatch.setattr(awq_search, "CLIP_ELEMENTS", 64 * 64 * 5)  # 5 rows per batch
    assert torch.equal(search_clip(w, x, scheme, 20), whole)


def test_row_gain_is_each_outputs_least_squares_fit():
    from quantkit.quant.awq_search import row_gain

    y_hat = torch.tensor([[1.0, 0.0, 1.0], [2.0, 0.0, -1.0]])
    y = torch.tensor([[2.0, 5.0, -1.0], [4.0, 1.0, 1.0]])
    # column 0: y = 2 y_hat; column 1: y_hat all zero (no fit: 1); column 2: a negative fit (kept at 1)
    assert torch.equal(row_gain(y, y_hat), torch.tensor([2.0, 1.0, 1.0]))


def test_a_fitted_gain_undoes_a_shrink_and_lowers_the_output_error():
    from quantkit.format.primitives import QuantScheme, rtn_quantize
    from quantkit.quant.awq_search import fitted_row_gain, with_row_gain

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 64, generator=g), torch.randn(256, 64, generator=g)
    shrunk = rtn_quantize(0.8 * w, QuantScheme(4, 32, False))  # a uniformly shrunk rounding of w
    gain = fitted_row_gain(shrunk, x, w)
    assert bool(((gain > 1.15) & (gain < 1.35)).all())
    fitted = with_row_gain(shrunk, gain)
    assert torch.equal(fitted.qweight, shrunk.qweight) and torch.equal(fitted.zeros, shrunk.zeros)
    assert torch.equal(fitted.scales, fitted.scales.half().float())  # the fp16 scales the checkpoint stores

    def error(q):
        return float((x @ q.dequantize().T - x @ w.T).pow(2).sum())

    assert error(fitted) < 0.5 * error(shrunk)
