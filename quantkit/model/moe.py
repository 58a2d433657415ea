"""A sparse mixture-of-experts block with one nn.Linear per expert, under the checkpoint's names.

transformers 5 holds an MoE layer's experts as stacked 3-D parameters (`experts.gate_up_proj`
[E, 2I, H]) and converts the per-expert tensors of a checkpoint (`experts.<e>.w1.weight`) at load.
Quantization needs each expert's linears apart (hooks, per-expert Hessians, packed tensors under
per-expert names, which vLLM and transformers read), so the pipeline, the checker and the
evaluator replace that block with `SparseMoeBlock` (`linearize_experts`), which computes the same
function as transformers' Mixtral and Qwen3-MoE blocks:

    probs = softmax(router(x))           [T, E] fp32
    w, e  = top_k(probs)                 [T, k]; renormalized to sum 1 where the family does
    y     = sum_j w_j * expert_{e_j}(x)  each expert down(act(gate(x)) * up(x)), experts in ascending order

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


def unstack_experts(spec: ExpertsSpec, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A stacked experts tensor of the checkpoint (ExpertsSpec.stacked: `<layer>.<block>.<experts>.<name>` [E, in, out]
    or `<name>_bias` [E, out]) as one linear's tensors per expert, `<layer>.<block>.<experts>.<e>.<name>.weight`
    [out, in] and `.bias` [out]; the gate_up projection's interleaved output columns (g0, u0, g1, ...) put in
    [gate | up] order, as a fused gate/up linear computes them. None for any other key."""
    if not spec.stacked:
        return None
    head = f".{spec.block}.{spec.experts}."
    prefix, found, leaf = key.rpartition(head)
    name, bias = (leaf[:-len("_bias")], True) if leaf.endswith("_bias") else (leaf, False)
    if not found or name not in (spec.gate_up, spec.down):
        return None
    if name == spec.gate_up:
        width = tensor.shape[-1]
        order = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
        tensor = tensor.index_select(-1, order)
    out = {}
    for e in range(tensor.shape[0]):
        part = tensor[e] if bias else tensor[e].t()
        out[f"{prefix}{head}{e}.{name}.{'bias' if bias else 'weight'}"] = part.contiguous()
    return out


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its linears named as the family's checkpoint names them."""

    def __init__(self, spec: ExpertsSpec, hidden: int, intermediate: int, act):
        super().__init__()
        self.names = (spec.gate, spec.up, spec.down)
        setattr(self, spec.gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, spec.up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, spec.down, nn.Linear(intermediate, hidden, bias=False))
        self.act = act

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's input: act(gate(x)) * up(x), [n, I]."""
        gate, up, _ = (getattr(self, n) for n in self.names)
        return self.act(gate(x)) * up(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.names[2])(self.hidden(x))


class SparseMoeBlock(nn.Module):
    """An MoE block with one Expert module per expert (see the module docstring). x [..., H] -> [..., H]."""

    def __init__(self, spec: ExpertsSpec, shape: MoEShape, hidden: int, act):
        super().__init__()
        self.spec, self.shape = spec, shape
        setattr(self, spec.router, nn.Linear(hidden, shape.num_experts, bias=False))
        setattr(self, spec.experts, nn.ModuleList(Expert(spec, hidden, shape.intermediate, act)
                                                  for _ in range(shape.num_experts)))

    @property
    def router(self) -> nn.Linear:
        return getattr(self, self.spec.router)

    @property
    def expert_list(self) -> nn.ModuleList:
        return getattr(self, self.spec.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, experts [T, k])."""
        return route(self.router(x), self.shape.top_k, self.shape.renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for b in expert_batches(weights, experts, self.shape.num_experts):
            y = self.expert_list[b.expert](x[b.rows]) * b.weights[:, None]
            out.index_add_(0, b.rows, y.to(out.dtype))
        return out.view_as(hidden)


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
    any device, typically meta) by a SparseMoeBlock on the same device, weights unset. Returns how many: none for
    a dense family, or one whose checkpoint stacks the experts as transformers does (gpt-oss: a float checkpoint
    then loads into transformers' own block; quantize refuses it, ArchSpec.check_quantizable)."""
    from transformers.activations import ACT2FN

    moe = moe_shape(spec, config)
    if moe is None or spec.experts.stacked:  # stacked (gpt-oss): the checkpoint's tensors are transformers' own
        return 0
    layers = get_submodule(model, spec.layers)
    device = next(layers[0].parameters()).device
    act = ACT2FN[config.hidden_act]
    for layer in layers:
        with torch.device(device):
            block = SparseMoeBlock(spec.experts, moe, config.hidden_size, act).to(dtype)
        install_block(layer, spec.experts, block)
    return len(layers)
