"""The contract between the layer-by-layer pipeline and a quantization method.

The pipeline (quantkit.quant.pipeline) owns loading, calibration capture, propagation
of activations from layer to layer, packing and writing. A method sees one decoder layer
at a time through a `LayerContext` and returns a `LayerResult`:

* it quantizes every linear named in `ctx.linears` (those that can be packed; the others stay
  float and are listed in `ctx.skipped`),
* it leaves each quantized linear's `.weight` set to the dequantized (fake-quantized) weight,
  so the pipeline's re-run of the layer feeds quantized outputs to the next layer,
* it may change other float tensors of the layer (AWQ folds scales into norms and linears);
  the pipeline writes the layer's float tensors as the method leaves them.

An MoE layer's experts come after (`quantize_experts`, quantkit.quant.moe_experts): as soon as the method is
done with one expert it says so (`MoEContext.expert_done`), and the pipeline packs and writes that expert's
linears then, so a layer's integer weights never wait all together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from quantkit.config import QuantizeConfig
from quantkit.format.arch import ArchSpec, get_submodule
from quantkit.format.primitives import QuantizedWeight, QuantScheme


class _Reached(Exception):
    """Raised by run_until's pre-hook: the module it waited for has its input."""


@dataclass
class LayerContext:
    index: int
    layer: nn.Module  # the decoder layer, real weights in the compute dtype (fp32), on ctx.device
    spec: ArchSpec
    model_config: object  # the transformers config (num_attention_heads, num_key_value_heads, ...)
    inputs: list[torch.Tensor]  # calibration hidden states in batches of samples, each [batch, seq, hidden]
    layer_kwargs: dict  # what the decoder layer's forward takes besides hidden states (RoPE, mask, ...)
    scheme: QuantScheme
    config: QuantizeConfig
    linears: tuple[str, ...]  # linears to quantize, relative to the layer, in true-sequential order
    skipped: dict[str, str]  # linears left float -> reason
    device: torch.device = torch.device("cpu")
    # dtype of the layer's forward passes (bf16: under autocast, the weights and the residual stream stay fp32)
    compute_dtype: torch.dtype = torch.float32
    experts: frozenset[str] = frozenset()  # an MoE layer's expert linears to quantize after these (quantize_experts)
    # the experts' weights are not in the layer: each is read on its turn in quantize_experts (the method's
    # streams_experts), so a run of the whole layer is impossible before then (run_until stops at the block)
    experts_streamed: bool = False
    # the float model's hidden states entering this layer, batched as `inputs` (methods whose needs_float_stream)
    float_inputs: list[torch.Tensor] | None = None

    def autocast(self):
        """The context every forward pass of the layer runs in: autocast to compute_dtype (off for fp32), without
        autocast's weight cache (it would hold a bf16 copy of every weight the pass touched beside the fp32 layer
        until the context ends: 1.2 GB more on a Qwen3-30B-A3B-shaped layer)."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32,
                              cache_enabled=False)

    def run_for_hooks(self, stop: type[Exception], inputs: list[torch.Tensor] | None = None) -> None:
        """Run the layer on every calibration input (or `inputs`) for its hooks' sake; a hook raising `stop` ends
        that run (what comes after the hooked module is not needed)."""
        with torch.no_grad(), self.autocast():
            for x in self.inputs if inputs is None else inputs:
                try:
                    self.layer(x, **self.layer_kwargs)
                except stop:
                    pass

    def run_until(self, path: str, inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The input of the layer's submodule `path` for each input (default: the calibration inputs), fp32 and
        shaped as that input ([batch, seq, K]): each run stops there, the rest of the layer is not run."""
        seen: list[torch.Tensor] = []

        def hook(_module, args):
            seen.append(args[0].float())
            raise _Reached

        handle = get_submodule(self.layer, path).register_forward_pre_hook(hook)
        try:
            self.run_for_hooks(_Reached, inputs)
        finally:
            handle.remove()
        return seen

    def run_layer(self, inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Outputs of the layer, as it is now, for each input (default: the calibration inputs), fp32."""
        outs = []
        with torch.no_grad(), self.autocast():
            for x in self.inputs if inputs is None else inputs:
                out = self.layer(x, **self.layer_kwargs)
                outs.append((out[0] if isinstance(out, tuple) else out).float())
        return outs


@dataclass
class LayerResult:
    weights: dict[str, QuantizedWeight]  # relative linear name -> integer weight (original column order)
    losses: dict[str, float] = field(default_factory=dict)  # per-linear error (GPTQ: its objective)
    stats: dict = field(default_factory=dict)  # method-specific numbers for quantkit_meta.json
    plan: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors saved with the checkpoint (AWQ)
    # the layer's outputs on ctx.inputs with the quantized weights, when the method ran them anyway
    # (the pipeline then feeds these to the next layer instead of running the layer again)
    outputs: list[torch.Tensor] | None = None
    outputs_are_float: bool = False  # `outputs` are the float layer's (AWQ --awq-next-inputs float)
    # the float layer's outputs on ctx.float_inputs: the float model's stream into the next layer (GPTAQ)
    float_outputs: list[torch.Tensor] | None = None
    # linears whose integer weights were handed on (written) as soon as they were final, so not in `weights`
    written: set[str] = field(default_factory=set)

    @property
    def quantized(self) -> set[str]:
        """Every linear the method quantized: those in `weights` and those already written."""
        return set(self.weights) | self.written


def merge_results(first: LayerResult, then: LayerResult) -> LayerResult:
    """One layer's result from two stages (the dense linears, then an MoE layer's experts). The second stage's
    outputs, where it has them (streamed experts), are the layer's; the first stage's were computed before the
    second changed the layer, so of those only float outputs (`outputs_are_float`) are kept."""
    stats = {**first.stats, "experts": then.stats} if then.stats else first.stats
    outputs, are_float = (then.outputs, then.outputs_are_float) if then.outputs is not None else (
        (first.outputs, True) if first.outputs_are_float else (None, False))
    return LayerResult({**first.weights, **then.weights}, {**first.losses, **then.losses}, stats,
                       {**first.plan, **then.plan}, outputs, are_float, first.float_outputs,
                       first.written | then.written)


class LayerMethod(Protocol):
    name: str
    needs_calibration: bool
    # True: the method reads the float model's activations beside the quantized one's (ctx.float_inputs) and returns
    # the float layer's outputs (LayerResult.float_outputs)
    needs_float_stream: bool
    # True: an MoE layer's experts may be loaded one at a time, each on its turn in quantize_experts
    # (quantkit.quant.moe_experts); False: the method needs every expert in the layer at once
    streams_experts: bool

    def quantize_layer(self, ctx: LayerContext) -> LayerResult: ...

    def quantize_experts(self, moe) -> LayerResult:
        """An MoE layer's experts, after quantize_layer (quantkit.quant.moe_experts.MoEContext)."""
        ...
