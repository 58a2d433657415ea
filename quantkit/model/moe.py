"""A sparse mixture-of-experts block with one nn.Linear per expert, under the checkpoint's names.

transformers 5 holds an MoE layer's experts as stacked 3-D parameters (`experts.gate_up_proj`
[E, 2I, H]) and converts the per-expert tensors of a checkpoint (`experts.<e>.w1.weight`) at load.
Quantization needs each expert's linears apart (hooks, per-expert Hessians, packed tensors under
per-expert names, which vLLM and transformers read), so the pipeline, the checker and the
evaluator replace that block with `SparseMoeBlock` (`linearize_experts`), which computes the same
function as transformers' Mixtral, Qwen3-MoE and gpt-oss blocks:

    probs = softmax(router(x))           [T, E] fp32
    w, e  = top_k(probs)                 [T, k]; renormalized to sum 1 where the family does
    y     = sum_j w_j * expert_{e_j}(x)  each expert down(act(gate(x)) * up(x)), experts in ascending order

gpt-oss: the router and every expert linear have biases, its softmax over the top k logits is the renormalized top k
of the full softmax, and each expert is down(swiglu_oai(gate, up)) over one gate_up linear whose rows interleave gate
and up; its checkpoints stack the experts, read one linear per expert (quantkit.model.stacked_experts).

`route` and `expert_batches` are the pure parts, shared with the engine's MoE forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.format.arch import ArchSpec, ExpertsSpec, MoEShape, get_submodule, moe_shape


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64): softmax in fp32, the top k
    (ties to the lower index, as torch.topk), renormalized to sum 1 where asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass(frozen=True)
class ExpertBatch:
    """The tokens routed to one expert: their rows in the flat batch and their routing weights."""

    expert: int
    rows: torch.Tensor  # int64 [n]: token indices, ascending
    weights: torch.Tensor  # fp32 [n]


def expert_batches(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> list[ExpertBatch]:
    """Tokens grouped by expert (weights, experts [T, k] from `route`), for the experts that got any, in
    ascending expert order: one sort of the T * k choices instead of a mask per expert."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # choices of expert 0 first, tokens ascending within an expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    k = experts.shape[1]
    rows, w = order // k, weights.reshape(-1)[order]
    out, start = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append(ExpertBatch(e, rows[start:start + n], w[start:start + n]))
        start += n
    return out


SWIGLU = (1.702, 7.0)  # gpt-oss's (swiglu_alpha, swiglu_limit), where a config leaves them out


def swiglu_params(config) -> tuple[float, float]:
    """(alpha, limit) of gpt-oss's clamped SwiGLU from a transformers config."""
    return (float(getattr(config, "swiglu_alpha", None) or SWIGLU[0]),
            float(getattr(config, "swiglu_limit", None) or SWIGLU[1]))


def swiglu_oai_and_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its linears named as the family's checkpoint names them; for gpt-oss
    (ExpertsSpec.gate_up) down(swiglu_oai(gate, up)) with gate and up the even and odd rows of one gate_up linear."""

    def __init__(self, spec: ExpertsSpec, hidden: int, intermediate: int, act, swiglu: tuple[float, float] = ()):
        super().__init__()
        self.names, self.inputs, self.down_name = spec.projections, spec.inputs, spec.down
        width = 2 * intermediate if spec.gate_up else intermediate
        for name in self.inputs:
            setattr(self, name, nn.Linear(hidden, width, bias=spec.bias))
        setattr(self, spec.down, nn.Linear(intermediate, hidden, bias=spec.bias))
        self.act, self.swiglu = act, swiglu

    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """down's input [n, I] from the outputs of the input linears (in `inputs` order)."""
        if len(outputs) == 1:  # gate_up: rows interleaved g0, u0, g1, u1, ...
            return swiglu_oai_and_mul(outputs[0][..., 0::2], outputs[0][..., 1::2], *self.swiglu)
        return self.act(outputs[0]) * outputs[1]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """down's input: act(gate(x)) * up(x), [n, I]."""
        return self.combine([getattr(self, n)(x) for n in self.inputs])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.hidden(x))


class SparseMoeBlock(nn.Module):
    """An MoE block with one Expert module per expert (see the module docstring). x [..., H] -> [..., H]."""

    def __init__(self, spec: ExpertsSpec, shape: MoEShape, hidden: int, act, swiglu: tuple[float, float] = ()):
        super().__init__()
        self.spec, self.shape = spec, shape
        setattr(self, spec.router, nn.Linear(hidden, shape.num_experts, bias=spec.router_bias))
        setattr(self, spec.experts, nn.ModuleList(Expert(spec, hidden, shape.intermediate, act, swiglu)
                                                  for _ in range(shape.num_experts)))

    @property
    def router_linear(self) -> nn.Linear:  # not `router`: gpt-oss's router is stored under that very name
        return getattr(self, self.spec.router)

    @property
    def expert_list(self) -> nn.ModuleList:
        return getattr(self, self.spec.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, experts [T, k])."""
        return route(self.router_linear(x), self.shape.top_k, self.shape.renormalize)

    def forward(self, hidden: torch.Tensor):
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for b in expert_batches(weights, experts, self.shape.num_experts):
            y = self.expert_list[b.expert](x[b.rows]) * b.weights[:, None]
            out.index_add_(0, b.rows, y.to(out.dtype))
        return as_block_output(self.spec, out.view_as(hidden))


def as_block_output(spec: ExpertsSpec, out: torch.Tensor):
    """What transformers' decoder layer takes from its MoE block: the output, or (output, router scores) where the
    family's layer unpacks a pair (its scores unused there: None)."""
    return (out, None) if spec.returns_pair else out


def install_block(layer: nn.Module, spec: ExpertsSpec, block: nn.Module) -> None:
    """Put `block` in `layer` under the checkpoint's name (state_dict and named_modules use it). Where
    transformers' layer calls its MoE block by another attribute (Mixtral: `mlp` for the checkpoint's
    `block_sparse_moe`), that attribute is set as a plain instance attribute pointing at the same module, so
    the layer's forward finds it and it is not registered (nor saved) twice."""
    if spec.hf_attr in layer._modules:
        delattr(layer, spec.hf_attr)
    setattr(layer, spec.block, block)
    if spec.hf_attr != spec.block:
        object.__setattr__(layer, spec.hf_attr, block)


def linearize_experts(model: nn.Module, spec: ArchSpec, config, dtype: torch.dtype) -> int:
    """Replace every decoder layer's transformers MoE block of `model` (a transformers CausalLM, its weights on
    any device, typically meta) by a SparseMoeBlock on the same device, weights unset. Returns how many. (gpt-oss's
    checkpoints stack the experts: they are read one linear per expert, quantkit.model.stacked_experts.)"""
    from transformers.activations import ACT2FN

    moe = moe_shape(spec, config)
    if moe is None:
        return 0
    layers = get_submodule(model, spec.layers)
    device = next(layers[0].parameters()).device
    act = ACT2FN[config.hidden_act]
    swiglu = swiglu_params(config)
    for layer in layers:
        with torch.device(device):
            block = SparseMoeBlock(spec.experts, moe, config.hidden_size, act, swiglu).to(dtype)
        install_block(layer, spec.experts, block)
    return len(layers)
