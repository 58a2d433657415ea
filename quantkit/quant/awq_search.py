"""AWQ math as small pure functions: activation statistics, candidate scales, fake quantization,
and the per-group clipping search.

Conventions (see quantkit.format.primitives): W [N, K] (out, in), groups of G columns along K,
x [T, K] (tokens, in). An AWQ scale s [K] multiplies the weight's input columns (W * s) and
divides the input (x / s), so x @ W.T is unchanged in float; quantizing W * s instead of W
protects the input channels where |x| is large (the paper's "salient" channels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.format.primitives import QuantizedWeight, QuantScheme, minmax_params, round_scale

SCALE_FLOOR = 1e-4  # as llm-awq: keeps x_mean**ratio away from 0 for dead channels
CLIP_MAX_SHRINK = 0.5  # the clip grid tries max|w| * (1 - i / grid) down to (but not including) half
CLIP_TOKENS = 512  # tokens sampled for the clip search
FAKE_QUANT_ROWS = 2048  # groups fake-quantized at once in place (1 MiB of fp32 at 128 wide: in a core's L2)
CLIP_ELEMENTS = 2**25  # cap on the clip search's temporaries: N_batch * K * (T by the tokens, 1 by the Gram) floats


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Quantize then dequantize W [N, K] group by group: the same numbers as
    `rtn_quantize(w, scheme).dequantize()`, vectorized over groups (min-max is row-wise)."""
    return fake_quantize_(w.to(torch.float32, memory_format=torch.contiguous_format, copy=True), scheme)


def fake_quantize_(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """fake_quantize in place on an fp32 W [N, K] (returned): each slice of FAKE_QUANT_ROWS groups through every
    step while it is in cache, with no temporary of W's size (the search's hot path: 2.5-3x faster than a new
    tensor a step on Qwen3-30B-A3B's expert shape; the same operations on each value, so the same bits)."""
    n, k = w.shape
    g = scheme.group_len(k)
    for rows in w.view(n * (k // g), g).split(FAKE_QUANT_ROWS):  # one row per (output, group)
        scale, zero = minmax_params(rows, scheme.bits, scheme.sym)
        s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
        rows.div_(s).round_().add_(z).clamp_(0, scheme.maxq).sub_(z).mul_(s)  # quantize_codes, dequantize_codes
    return w


def act_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    """Mean |x| per input channel over every token of every sample: xs [.., K] -> [K] fp32."""
    total = None
    count = 0
    for x in xs:
        flat = x.reshape(-1, x.shape[-1]).float()
        part = flat.abs().sum(dim=0)
        total = part if total is None else total + part
        count += flat.shape[0]
    return total / count


def weight_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Duo scaling's weight statistic: mean over output rows of |W| normalized by its group's max.

    weights: the group's linears, each [N_i, K]. Returns [K] fp32.
    """
    w = torch.cat([x.float() for x in weights], dim=0)  # [sum N_i, K]
    n, k = w.shape
    g = scheme.group_len(k)
    grouped = w.abs().reshape(n, k // g, g)
    normed = grouped / grouped.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return normed.reshape(n, k).mean(dim=0)


def candidate_scale(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """s = x_mean**ratio (or x_mean**ratio / w_mean**(1 - ratio) with duo scaling), normalized
    so that max(s) * min(s) = 1 (the geometric middle of the range sits at 1). [K] fp32."""
    s = x_mean.pow(ratio)
    if w_mean is not None:
        s = s / w_mean.pow(1 - ratio)
    s = s.clamp(min=SCALE_FLOOR)
    return s / (s.max() * s.min()).sqrt()


def input_gram(xs: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """X^T X [K, K] fp32 over every token of xs ([.., K] each), and the number of tokens."""
    gram, tokens = None, 0
    for x in xs:
        flat = x.reshape(-1, x.shape[-1]).float()
        part = flat.T @ flat
        gram = part if gram is None else gram + part
        tokens += flat.shape[0]
    return gram, tokens


def linear_output_mse(delta: torch.Tensor, gram: torch.Tensor, tokens: int) -> float:
    """Mean over tokens and outputs of (x . dw_n)^2 for a weight change delta [N, K], from the inputs'
    Gram matrix [K, K]: sum((dW G) * dW) / (T N), the error of x @ (W + dW)^T against x @ W^T
    without running the T tokens (N K^2 multiply-adds instead of T N K)."""
    return float(((delta @ gram) * delta).sum()) / (tokens * delta.shape[0])


def output_error(xs: list[torch.Tensor]) -> Callable[[torch.Tensor], float]:
    """error(delta): linear_output_mse over the tokens of xs ([.., K] each) for a weight change delta [N, K], by the
    cheaper of its two exact forms per candidate: through the Gram matrix (N K^2 multiply-adds) when there are more
    tokens T than input features K, else on the tokens themselves (T N K). An 8B model's down_proj (K = 14336) judged
    on 2048 tokens: 7x fewer by the tokens; a small model's linears on thousands of tokens: fewer by the Gram."""
    tokens = sum(x.numel() // x.shape[-1] for x in xs)
    if tokens > xs[0].shape[-1]:
        gram, tokens = input_gram(xs)
        return lambda delta: linear_output_mse(delta, gram, tokens)
    x = torch.cat([t.reshape(-1, t.shape[-1]).float() for t in xs])  # [T, K]
    return lambda delta: float((x @ delta.T).square().sum()) / (tokens * delta.shape[0])


def ratio_grid(n_grid: int) -> list[float]:
    """The exponents tried without duo scaling: i / n for i in 0 .. n - 1 (so [0, 1)), llm-awq's grid."""
    return [i / n_grid for i in range(n_grid)]


def duo_ratio_grid(n_grid: int) -> list[float]:
    """The exponents tried with duo scaling: n - 1 points from 0 to 1 inclusive, which with the
    identity make n candidates (llm-compressor's grid). Measured against duo on ratio_grid: the GQA
    test model 1.0044x -> 1.0034x, stories260K 1.0168x -> 0.9933x (docs/BENCHMARKS.md)."""
    return [i / (n_grid - 2) for i in range(n_grid - 1)]


def scaled_fake_weight(w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Q(W * s) / s: what the linear computes on the unscaled input once s is folded. [N, K]."""
    return fake_quantize_(w.float() * s, scheme).div_(s)


@dataclass(frozen=True)
class ScaleCandidate:
    """One candidate AWQ scale: its exponent, whether the weight statistic enters (duo scaling), s [K] fp32."""

    ratio: float
    duo: bool
    scale: torch.Tensor


@dataclass(frozen=True)
class ScaleChoice:
    """The search's answer for one smoothing group: the chosen candidate, its loss, and every candidate's loss
    in the order tried (losses[0]: the identity, which every mode tries first)."""

    best: ScaleCandidate
    loss: float
    losses: list[float]

    def stats(self) -> dict:
        """For quantkit_meta.json: the chosen ratio and formula (duo: the weight statistic entered), the unscaled
        loss (the identity) and the chosen one."""
        return {"ratio": self.best.ratio, "duo": self.best.duo, "loss_unscaled": self.losses[0],
                "loss_scaled": self.loss}


def scale_candidates(x_mean: torch.Tensor, w_mean: torch.Tensor | None, n_grid: int,
                     duo_scaling: str) -> list[ScaleCandidate]:
    """The candidates of one group, the identity first, for a duo_scaling mode (quantkit.config.DUO_SCALINGS):

      "false": x_mean**r for r in ratio_grid (llm-awq; r = 0 is the identity);
      "true":  the identity, then x_mean**r / w_mean**(1 - r) for r in duo_ratio_grid (no point of that
               grid is the identity: r = 0 gives 1 / w_mean);
      "both":  both lists, the identity once, so the group keeps whichever formula gives the lower loss (as
               llm-compressor's duo_scaling="both", which splits its grid in two; here each formula keeps its
               whole grid, so "both" is never worse on a group than either alone).
    w_mean is needed for "true" and "both" (weight_mean of the group's linears)."""
    plain = [ScaleCandidate(r, False, candidate_scale(x_mean, None, r)) for r in ratio_grid(n_grid)]
    if duo_scaling == "false":
        return plain
    if w_mean is None:
        raise ValueError(f"duo_scaling {duo_scaling!r} needs the weight statistic w_mean")
    duo = [ScaleCandidate(r, True, candidate_scale(x_mean, w_mean, r)) for r in duo_ratio_grid(n_grid)]
    identity = ScaleCandidate(0.0, False, torch.ones_like(x_mean))
    return {"true": [identity, *duo], "both": [*plain, *duo]}[duo_scaling]


def search_scale(candidates: list[ScaleCandidate], loss_of: Callable[[torch.Tensor], float]) -> ScaleChoice:
    """The candidate with the lowest `loss_of(s)`: the output error of the inspected module with the group's
    weights set to Q(W * s) / s (choose_scale)."""
    return choose_scale(candidates, [loss_of(cand.scale) for cand in candidates])


def choose_scale(candidates: list[ScaleCandidate], losses: list[float]) -> ScaleChoice:
    """The candidate of the lowest loss (losses[i]: candidates[i]'s). Non-finite losses are never chosen; ties keep
    the earlier candidate."""
    best, best_loss = None, float("inf")
    for cand, loss in zip(candidates, losses, strict=True):
        if loss < best_loss:
            best, best_loss = cand, loss
    if best is None:
        raise RuntimeError(f"AWQ scale search found no finite loss (losses: {losses})")
    return ScaleChoice(best, best_loss, losses)


def clip_sample(xs: list[torch.Tensor], max_tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """An evenly strided sample of at most `max_tokens` tokens from every sample: [T, K] fp32."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs], dim=0).float()
    step = max(1, x.shape[0] // max_tokens)
    return x[::step][:max_tokens]


def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, n_grid: int,
                max_shrink: float = CLIP_MAX_SHRINK) -> torch.Tensor:
    """Per (output row, group) clip threshold minimizing that group's share of the output error.

    w: [N, K] (already scaled), x: [T, K] (already scaled). Each candidate clamps the group to
    [-m, m] with m = max|w_group| * (1 - i / n_grid), fake-quantizes, and scores the group by the mean over
    tokens of (x_g . (q_g - w_g))^2, the error of its partial dot products (group_error). Returns max_val [N, G]
    fp32.
    """
    w = w.float()
    n, k = w.shape
    g = scheme.group_len(k)
    error, per_row = group_error(x.float().reshape(-1, k // g, g))
    batch = max(1, min(n, CLIP_ELEMENTS // max(1, per_row * k)))
    out = []
    for start in range(0, n, batch):
        out.append(_clip_rows(w[start:start + batch], error, scheme, g, n_grid, max_shrink))
    return torch.cat(out, dim=0)


def group_error(xg: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """error(d) [n, G]: mean over the T tokens of xg [T, G, g] of (x_g . d_g)^2 for a weight change d [n, G, g],
    by the cheaper of its two exact forms: through each group's Gram matrix X_g^T X_g / T [G, g, g] (n K g
    multiply-adds a candidate) when T > g, else on the tokens (n K T; AWQ's clip sample is 512 tokens, its groups
    128 wide: 4x fewer by the Gram matrix). Also the temporaries' floats per weight, for batching rows."""
    tokens, _, g = xg.shape
    if tokens > g:
        gram = torch.einsum("tjc,tjd->jcd", xg, xg) / tokens  # [G, g, g]

        def by_gram(d: torch.Tensor) -> torch.Tensor:
            dt = d.transpose(0, 1)  # [G, n, g]
            return ((dt @ gram) * dt).sum(dim=-1).T
        return by_gram, 1
    return (lambda d: torch.einsum("tjc,njc->ntj", xg, d).pow(2).mean(dim=1)), tokens


def _clip_rows(w: torch.Tensor, error, scheme: QuantScheme, g: int, n_grid: int, max_shrink: float) -> torch.Tensor:
    """search_clip for a slice of rows: w [n, K], error: group_error's -> max_val [n, G]."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    org_max = wg.abs().amax(dim=-1)  # [n, G]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        q = fake_quantize(clip_weight(w, max_val), QuantScheme(scheme.bits, g, scheme.sym))
        err = error(q.reshape(n, k // g, g) - wg)  # [n, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def clip_weight(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp W [N, K] to [-max_val, max_val] per (row, group); max_val [N, G]."""
    n, k = w.shape
    ng = max_val.shape[1]
    m = max_val.to(w.dtype).unsqueeze(-1)  # [N, G, 1]
    return torch.clamp(w.reshape(n, ng, k // ng), -m, m).reshape(n, k)


def row_gain(y: torch.Tensor, y_hat: torch.Tensor) -> torch.Tensor:
    """Per output column n of y [T, N] (a linear's float outputs) and y_hat (its quantized outputs): the gain a_n that
    minimizes ||y_n - a_n y_hat_n||^2, <y_n, y_hat_n> / <y_hat_n, y_hat_n>; 1 where that is not a positive finite
    number (an output the quantized weight zeroes)."""
    a = (y * y_hat).sum(0) / (y_hat * y_hat).sum(0)
    return torch.where(torch.isfinite(a) & (a > 0), a, torch.ones_like(a))


def fitted_row_gain(qw: QuantizedWeight, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The row_gain [N] of qw's outputs on the inputs x [T, K] against the float weight w [N, K]. Clipping a group's
    range shrinks the weight along itself (a clipped row's least-squares gain is above 1), which a gain of the whole
    row undoes where the inputs show it: on the accuracy suite it lowered AWQ's KL from float on every model
    (docs/BENCHMARKS.md)."""
    return row_gain(x @ w.T, x @ qw.dequantize().to(x.device).T)


def with_row_gain(qw: QuantizedWeight, gain: torch.Tensor) -> QuantizedWeight:
    """qw with each output row's scales times gain [N], rounded to the fp16 scales the checkpoint stores; the codes
    and zeros stay."""
    scales = round_scale(qw.scales * gain.to(qw.scales.device))
    return QuantizedWeight(qw.qweight, scales, qw.zeros, qw.g_idx, qw.scheme)
