"""Round-to-nearest: the baseline method. Needs no calibration data."""

from __future__ import annotations

import torch

from quantkit.config import QuantizeConfig
from quantkit.format.arch import get_submodule
from quantkit.quant.methods import LayerContext, LayerResult


class RTNMethod:
    name = "rtn"
    needs_calibration = False

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        from quantkit.format.primitives import rtn_quantize

        weights, losses = {}, {}
        for name in ctx.linears:
            linear = get_submodule(ctx.layer, name)
            qw = rtn_quantize(linear.weight.data, ctx.scheme)
            w_hat = qw.dequantize().to(linear.weight.dtype)
            losses[name] = float(torch.sum((linear.weight.data.float() - w_hat.float()) ** 2))
            linear.weight.data = w_hat
            weights[name] = qw
        return LayerResult(weights=weights, losses=losses)
