"""Round-to-nearest: the baseline method. Needs no calibration data, unless its group scales are searched
against the calibration inputs (--scale-search imatrix)."""

from __future__ import annotations

import torch

from quantkit.config import QuantizeConfig
from quantkit.format.arch import get_submodule
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize
from quantkit.quant.imatrix import collect_importance
from quantkit.quant.methods import LayerContext, LayerResult
from quantkit.quant.scale_search import SearchGrid, searched_quantize_many
from quantkit.quant.weight_prior import expert_mean_squares, layer_mean_squares

WEIGHTED_SEARCHES = ("imatrix", "prior")  # the searches that weight each input channel's error


def quantize_weights(ws: list[torch.Tensor], scheme: QuantScheme, scale_search: str = "minmax",
                     importance: list[torch.Tensor] | None = None) -> list[QuantizedWeight]:
    """Each W [N, K] rounded to nearest, its group scales and zeros from min-max or searched
    (quantkit.quant.scale_search: `mse` on the weight error, `imatrix` and `prior` weighted by each weight's
    importance [K], measured or estimated: quantkit.quant.weight_prior);
    searched weights together, in one search over all their groups (a layer of small linears then costs about one
    call's overhead, not one per linear)."""
    if scale_search == "minmax":
        return [rtn_quantize(w, scheme) for w in ws]
    return searched_quantize_many(ws, scheme, importance if scale_search in WEIGHTED_SEARCHES else None,
                                  SearchGrid(data_free=scale_search == "prior"))


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
        self.needs_calibration = cfg.scale_search == "imatrix"  # the inputs' mean square per channel

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        result = LayerResult(weights={})
        importance = None
        if self.cfg.scale_search == "imatrix":
            importance = collect_importance(ctx, list(ctx.linears))
        elif self.cfg.scale_search == "prior":
            importance = _every(ctx.layer, ctx.linears, layer_mean_squares(ctx.layer, ctx.spec, ctx.model_config,
                                                                            ctx.linears))
        rtn_linears(ctx.layer, ctx.linears, ctx.scheme, result, self.cfg.scale_search, importance)
        return result

    def quantize_experts(self, moe) -> LayerResult:
        """Every quantized expert's linears (quantkit.quant.moe_experts.MoEContext), one expert at a time (min-max,
        or a data-free search: `imatrix` takes `mse` here, the experts' own inputs are not collected)."""
        result = LayerResult(weights={})
        search = {"minmax": "minmax", "prior": "prior"}.get(self.cfg.scale_search, "mse")
        ctx = moe.layer
        for _, names in moe.expert_linears():
            importance = None if search != "prior" else \
                _every(ctx.layer, names, expert_mean_squares(ctx.layer, ctx.spec, ctx.model_config, names))
            rtn_linears(ctx.layer, names, ctx.scheme, result, search, importance)
            moe.expert_done(result, names)
        return result


def _every(layer: torch.nn.Module, names, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`found` for each linear in `names`, ones (the plain weight error) for a linear it lacks."""
    return {n: found[n] if n in found else torch.ones(get_submodule(layer, n).weight.shape[1]) for n in names}
