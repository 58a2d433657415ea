"""The importance of each input channel of a decoder layer's linears: the mean square of its calibration inputs.

imp_k = E[x_k^2] over every calibration token (llama.cpp's imatrix, llm-compressor's imatrix_mse observer): the
expected output error of a weight error dw in column k is imp_k * dw_k^2 when the input channels are uncorrelated,
so it weights scale_search's error. GPTQ reads the same statistic off its Hessian's diagonal (2 E[x x^T]).
"""

from __future__ import annotations

import torch

from quantkit.quant.capture import fold_linear_inputs
from quantkit.quant.methods import LayerContext


def add_squares(state: tuple[torch.Tensor, int] | None, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running sum of x^2 per channel and token count: x [..., K] (any float dtype) -> (sum [K] fp32, tokens)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    part = flat.square().sum(dim=0)
    if state is None:
        return part, flat.shape[0]
    return state[0] + part, state[1] + flat.shape[0]


def collect_importance(ctx: LayerContext, names: list[str]) -> dict[str, torch.Tensor]:
    """E[x^2] [K] fp32 of each linear in `names` on the layer's calibration inputs, in one run of the layer as it
    is now."""
    return {n: total / count for n, (total, count) in fold_linear_inputs(ctx, names, add_squares).items()}
