"""Round-to-nearest: the baseline method. Needs no calibration data, unless its group scales are searched
against the calibration inputs (--scale-search imatrix)."""

from __future__ import annotations

import torch

from quantkit.config import DATA_FREE_FALLBACK, SCALE_SEARCHES, QuantizeConfig
from quantkit.format.arch import get_submodule
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize
from quantkit.quant.imatrix import collect_importance
from quantkit.quant.methods import LayerContext, LayerResult
from quantkit.quant.scale_search import SearchGrid, searched_quantize_many
from quantkit.quant.weight_prior import expert_mean_squares, layer_mean_squares


def quantize_weights(ws: list[torch.Tensor], scheme: QuantScheme, scale_search: str = "minmax",
                     importance: list[torch.Tensor] | None = None) -> list[QuantizedWeight]:
    """Each W [N, K] rounded to nearest, its group scales and zeros from min-max or searched
    (quantkit.quant.scale_search: `mse` on the weight error, `imatrix` and `prior` weighted by each weight's
    importance [K], measured or estimated: quantkit.quant.weight_prior);
    searched weights together, in one search over all their groups (a layer of small linears then costs about one
    call's overhead, not one per linear)."""
    search = SCALE_SEARCHES[scale_search]
    if not search.searched:
        return [rtn_quantize(w, scheme) for w in ws]
    return searched_quantize_many(ws, scheme, importance if search.weighted else None,
                                  SearchGrid(data_free=not search.measures_inputs))


def rtn_linears(layer: torch.nn.Module, names, scheme: QuantScheme, result: LayerResult, scale_search: str = "minmax",
                importance: dict[str, torch.Tensor] | None = None) -> None:
    """RTN on each linear of `layer` named in `names`: the dequantized weight left in place, the integer
    weight and the squared weight error recorded in `result`."""
    names = list(names)
    linears = [get_submodule(layer, name) for name in names]
    qws = quantize_weights([linear.weight.data for linear in linears], scheme, scale_search,
                           None if importance is None else [importance[name] for name in names])
    for name, linear, qw in zip(names, linears, qws):
        w_hat = qw.dequantize().to(linear.weight.dtype)
        result.losses[name] = float(torch.sub(linear.weight.data.float(), w_hat.float()).square_().sum())  # one temporary
        linear.weight.data = w_hat
        result.weights[name] = qw


class RTNMethod:
    name = "rtn"
    needs_float_stream = False
    streams_experts = True  # each expert's linears are quantized on their own

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg
        self.needs_calibration = cfg.search.measures_inputs  # the inputs' mean square per channel

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        result = LayerResult(weights={})
        importance = None
        if self.cfg.search.weighting == "measured":
            importance = collect_importance(ctx, list(ctx.linears))
        elif self.cfg.search.weighting == "estimated":
            importance = layer_mean_squares(ctx.layer, ctx.spec, ctx.model_config, ctx.linears)
        rtn_linears(ctx.layer, ctx.linears, ctx.scheme, result, self.cfg.scale_search, importance)
        return result

    def quantize_experts(self, moe) -> LayerResult:
        """Every quantized expert's linears (quantkit.quant.moe_experts.MoEContext), one expert at a time (min-max,
        or a data-free search: one that measures inputs takes DATA_FREE_FALLBACK here, the experts' own inputs are
        not collected)."""
        result = LayerResult(weights={})
        search = DATA_FREE_FALLBACK if self.cfg.search.measures_inputs else self.cfg.scale_search
        ctx = moe.layer
        for _, names in moe.expert_linears():
            importance = expert_mean_squares(ctx.layer, ctx.spec, ctx.model_config, names) \
                if SCALE_SEARCHES[search].weighted else None
            rtn_linears(ctx.layer, names, ctx.scheme, result, search, importance)
            moe.expert_done(result, names)
        return result

