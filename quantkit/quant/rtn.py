"""Round-to-nearest: the baseline method. Needs no calibration data."""

from __future__ import annotations

import torch

from quantkit.config import QuantizeConfig
from quantkit.format.arch import get_submodule
from quantkit.format.primitives import QuantScheme
from quantkit.quant.methods import LayerContext, LayerResult


def rtn_linears(layer: torch.nn.Module, names, scheme: QuantScheme, result: LayerResult) -> None:
    """RTN on each linear of `layer` named in `names`: the dequantized weight left in place, the integer
    weight and the squared weight error recorded in `result`."""
    from quantkit.format.primitives import rtn_quantize

    for name in names:
        linear = get_submodule(layer, name)
        qw = rtn_quantize(linear.weight.data, scheme)
        w_hat = qw.dequantize().to(linear.weight.dtype)
        result.losses[name] = float(torch.sum((linear.weight.data.float() - w_hat.float()) ** 2))
        linear.weight.data = w_hat
        result.weights[name] = qw


class RTNMethod:
    name = "rtn"
    needs_calibration = False

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        result = LayerResult(weights={})
        rtn_linears(ctx.layer, ctx.linears, ctx.scheme, result)
        return result

    def quantize_experts(self, moe) -> LayerResult:
        """Every quantized expert's linears (quantkit.quant.moe_experts.MoEContext), one expert at a time."""
        result = LayerResult(weights={})
        for _, names in moe.expert_linears():
            rtn_linears(moe.layer.layer, names, moe.layer.scheme, result)
        return result
