"""One decoder layer's turn in the layer loop (quantkit.quant.pipeline): read its weights from the checkpoint,
quantize it, compute its outputs for the next layer, and hand its tensors to the shard writer.

  read the layer's tensors in fp32 (an MoE layer's experts left out when the method streams them)
  -> method.quantize_layer -> the experts (quantkit.quant.moe_experts: each read on its turn, packed and written
     as soon as it is quantized) -> the outputs (the method's, or the layer re-run) -> the float tensors in their
     source dtypes and the packed linears to the writer -> the layer to the meta device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError
from quantkit.format.arch import get_submodule, moe_shape
from quantkit.format.primitives import QuantizedWeight
from quantkit.model.checkpoint import ShardReader
from quantkit.quant.methods import LayerContext, merge_results
from quantkit.quant.moe_experts import quantize_experts, streamed_expert_linears
from quantkit.quant.planning import QuantizePlan
from quantkit.quant.shard_writer import ShardWriter
from quantkit.quant.writer import packed_tensors


@dataclass
class LayerReport:
    index: int
    seconds: float
    losses: dict[str, float]
    stats: dict = field(default_factory=dict)


def check_finite(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise QuantkitError(f"{prefix}.{name}: weights contain NaN or inf")


def all_finite(t: torch.Tensor) -> bool:
    """Every element of t finite. A finite fp32 sum proves it (an inf or NaN anywhere makes the sum inf or NaN); only
    a sum that is not finite (those, or a sum past fp32's range) is checked element by element. A streamed MoE expert
    is read once per visit: isfinite(t).all() took 7-8 ms on a 768 x 2048 bf16 weight, the sum 0.3 ms."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def load_tensors(model, reader: ShardReader, keys: list[str], device: torch.device, prefix: str = ""):
    """The checkpoint's tensors `keys` into `model` in fp32, one converted at a time (names relative to `model` once
    `prefix.` is cut). Returns their source dtypes and load_state_dict's (missing, unexpected) keys."""
    cut = len(prefix) + 1 if prefix else 0
    tensors = {k[cut:]: reader.get(k) for k in keys}
    check_finite(tensors, prefix or "model")
    dtypes = {k: t.dtype for k, t in tensors.items()}
    loaded = model.load_state_dict({k: tensors.pop(k).float().to(device) for k in list(tensors)}, strict=False,
                                   assign=True)
    return dtypes, loaded


@dataclass
class LayerOutcome:
    """One layer's turn: its report, the method's plan tensors, the next layer's inputs, and the float model's next
    inputs where the method reads the float stream (GPTAQ's; else None)."""

    report: LayerReport
    plan: dict[str, torch.Tensor]
    outputs: list[torch.Tensor]
    float_outputs: list[torch.Tensor] | None


def quantize_one_layer(cfg, method, plan: QuantizePlan, reader, layers, i, hf_cfg, inputs, layer_kwargs, device,
                       writer: ShardWriter, dtype: torch.dtype = torch.float32,
                       float_inputs: list[torch.Tensor] | None = None) -> LayerOutcome:
    """Load layer i, quantize it, propagate the activations, and write its checkpoint tensors: an MoE layer's
    experts each as soon as the method is done with it, the rest once the layer is done."""
    t0 = time.perf_counter()
    spec = plan.spec
    prefix = f"{spec.layers}.{i}"
    layer = layers[i]
    ctx, dtypes, later = _read_layer(cfg, method, plan, reader, layer, i, hf_cfg, inputs, layer_kwargs, device, dtype,
                                     float_inputs)
    linears, experts = ctx.linears, ctx.experts
    result = method.quantize_layer(ctx)
    if spec.experts is not None:  # then the experts, one at a time, on the block's input with attention quantized
        linears += tuple(sorted(experts, key=spec.order_of))
        propagate = bool(inputs) and i < plan.num_layers - 1
        result = merge_results(result, _experts_step(ctx, method, reader, writer, prefix, later, propagate))
    missing = set(linears) - result.quantized
    if missing:
        raise RuntimeError(f"method {cfg.method} did not quantize {sorted(missing)} in layer {i}")
    outputs, float_outputs = _next_inputs(ctx, result, last=i == plan.num_layers - 1)
    writer.add(_float_tensors(layer, result.quantized, dtypes, prefix, later)
               | _packed(result.weights, cfg.layout, prefix))
    layers[i] = layer.to("meta")
    report = LayerReport(i, round(time.perf_counter() - t0, 3), result.losses, result.stats)
    return LayerOutcome(report, result.plan, outputs, float_outputs)


def _read_layer(cfg, method, plan: QuantizePlan, reader, layer, i, hf_cfg, inputs, layer_kwargs, device,
                dtype: torch.dtype, float_inputs) -> tuple[LayerContext, dict, set[str]]:
    """Layer i's tensors read into `layer` and its LayerContext; also the stored dtype of each tensor read, and the
    names (under the layer) of the streamed experts' tensors, read later on each expert's turn."""
    spec = plan.spec
    prefix = f"{spec.layers}.{i}"
    linears = tuple(n for n in spec.linears if f"{prefix}.{n}" in plan.quantized_set)
    moe = moe_shape(spec, hf_cfg)
    experts = frozenset(n for n in spec.expert_linears(moe.num_experts if moe else 0)
                        if f"{prefix}.{n}" in plan.quantized_set)
    # a method that streams experts gets them one at a time, read on their turn (quantkit.quant.moe_experts)
    streamed = streamed_expert_linears(spec.experts, moe.num_experts, experts) if moe and method.streams_experts \
        else frozenset()
    # a streamed expert's tensors (weights, and biases where it has them) are read on its turn and written with it
    later = {f"{n}.{p}" for n in streamed for p in ("weight", "bias") if f"{prefix}.{n}.{p}" in reader}
    keys = [k for k in reader.keys() if k.startswith(prefix + ".") and k[len(prefix) + 1:] not in later]
    dtypes, loaded = load_tensors(layer, reader, keys, device, prefix)
    absent, extra = sorted(set(loaded.missing_keys) - later), sorted(loaded.unexpected_keys)
    if absent or extra:
        raise QuantkitError(f"{prefix}: the checkpoint lacks {absent[:3]} or has unknown tensors {extra[:3]} "
                            f"for the model its config describes")
    ctx = LayerContext(
        index=i, layer=layer, spec=spec, model_config=hf_cfg, inputs=inputs, layer_kwargs=layer_kwargs,
        scheme=cfg.scheme, config=cfg, linears=linears,
        skipped={n: plan.skipped[f"{prefix}.{n}"] for n in spec.linears if f"{prefix}.{n}" in plan.skipped},
        device=device, compute_dtype=dtype, experts=experts, experts_streamed=bool(streamed), float_inputs=float_inputs,
    )
    return ctx, dtypes, later


def _experts_step(ctx: LayerContext, method, reader, writer: ShardWriter, prefix: str, later: set[str],
                  propagate: bool):
    """An MoE layer's experts after method.quantize_layer (quantkit.quant.moe_experts): each packed and written as
    soon as it is quantized; a streamed expert's tensors (`later`) read on its turn and its biases written with it."""
    def write_expert(weights: dict[str, QuantizedWeight]) -> None:  # its codes are dropped once written
        biases = {f"{prefix}.{n}.bias": get_submodule(ctx.layer, n).bias.detach()
                  .to(reader.dtype_of(f"{prefix}.{n}.bias"))
                  for n in weights if f"{n}.bias" in later}  # a streamed expert leaves the layer after this
        writer.add(_packed(weights, ctx.config.layout, prefix) | biases)

    def load_expert(names: tuple[str, ...]) -> None:
        load_tensors(ctx.layer, reader, [f"{prefix}.{n}.{p}" for n in names for p in ("weight", "bias")
                                         if f"{n}.{p}" in later], ctx.device, prefix)

    return quantize_experts(ctx, method, bool(ctx.inputs), write_expert,
                            load_expert if ctx.experts_streamed else None, propagate)


def _next_inputs(ctx: LayerContext, result, last: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The next layer's inputs (the method's outputs, or the quantized layer re-run) and, where the method read the
    float stream, the float model's; none after the last layer or without activations (RTN)."""
    if not ctx.inputs or last:  # RTN has no activations; the last layer's outputs feed nothing
        return [], None
    outputs = result.outputs if result.outputs is not None else ctx.run_layer()
    if ctx.float_inputs is None:
        return outputs, None
    if result.float_outputs is None:
        raise RuntimeError(f"method {ctx.config.method} read the float stream but returned no float outputs")
    return outputs, result.float_outputs


def _float_tensors(layer, quantized: set[str], dtypes: dict[str, torch.dtype], prefix: str,
                   written: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The layer's tensors that stay float (all but the quantized linears' weights, and those `written` already: a
    streamed expert's biases), in their source dtypes."""
    return {f"{prefix}.{name}": t.to(dtypes[name]) for name, t in layer.state_dict().items()
            if not (name.endswith(".weight") and name.rpartition(".")[0] in quantized) and name not in written}


def _packed(weights: dict[str, QuantizedWeight], layout: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of quantized linears (names relative to the layer at `prefix`), in `layout`."""
    return {k: v for name, qw in weights.items() for k, v in packed_tensors(qw, layout, f"{prefix}.{name}").items()}
