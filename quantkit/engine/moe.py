"""The engine's mixture-of-experts block (Mixtral, Qwen3-MoE) over a flat batch x [T, hidden].

A step routes every token (the float router, softmax in fp32, top k, renormalized where the family
does: quantkit.model.moe.route). 4-bit experts run in one grouped kernel call (`stack_experts`, kernels/moe_int4.py;
bf16 or fp32) while no expert gets as many rows as its kernels' dense crossover (decode, and prefill spread over many
experts).
Otherwise it groups the tokens by expert (one sort: expert_batches) and
runs each expert that got tokens once on all of its tokens: gate and up fused into one linear (at load,
like a dense MLP's: QuantLinear.concat for 4-bit experts, so one int4 kernel call), the activation,
down, then the routing weight, added into the output rows in ascending expert order (as
transformers does). Module names mirror the checkpoint's, so packed experts load by name.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from quantkit.engine.decoder_shape import DecoderShape
from quantkit.kernels import fused_ops_reference
from quantkit.kernels.moe_int4 import StackedExperts
from quantkit.model.moe import SWIGLU, expert_batches, route, swiglu_oai_and_mul


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's gate activation (transformers' gelu_pytorch_tanh) times up, in torch."""
    return nn.functional.gelu(gate, approximate="tanh") * up


def act_and_mul(ops, act: str, swiglu: tuple[float, float] = SWIGLU):
    """The op computing act(gate) * up for the shape's activation: the fused C++ SiLU where `ops` has it."""
    if act == "swiglu_oai":
        return functools.partial(swiglu_oai_and_mul, alpha=swiglu[0], limit=swiglu[1])
    return ops.silu_and_mul if act == "silu" else gelu_tanh_and_mul


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with its linears under `names` (gate, up, down); gate and up may arrive fused
    as `fused_name` (Phi-3's gate_up_proj: [gate | up]; gpt-oss's experts: rows interleaved, `interleaved`) or be
    fused at load (`fuse`)."""

    def __init__(self, hidden: int, intermediate: int, act: str, names: tuple[str, ...],
                 fused_name: str | None = None, bias: bool = False, swiglu: tuple[float, float] = SWIGLU,
                 interleaved: bool = False):
        super().__init__()
        self.act, self.down_name, self.swiglu, self.interleaved = act, names[-1], swiglu, interleaved
        self.gate_up_proj: nn.Module | None = None
        if fused_name is not None:  # stored fused: x -> [gate | up]
            self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
            self.fusable: tuple[str, ...] = ()
        else:
            for name in names[:2]:
                setattr(self, name, nn.Linear(hidden, intermediate, bias=bias))
            self.fusable = names[:2]  # fused at load (weights.fuse_projections) in this order
        setattr(self, names[-1], nn.Linear(intermediate, hidden, bias=bias))

    def fuse(self, gate_up: nn.Module) -> None:
        """Run gate/up as `gate_up` from now on (built at load from the loaded two: x -> [gate | up])."""
        for name in self.fusable:
            delattr(self, name)
        self.fusable = ()
        self.gate_up_proj = gate_up

    def forward(self, x: torch.Tensor, ops=fused_ops_reference) -> torch.Tensor:
        mul = act_and_mul(ops, self.act, self.swiglu)
        if self.gate_up_proj is None:
            gate, up = (getattr(self, n)(x) for n in self.fusable)
        elif self.interleaved:
            both = self.gate_up_proj(x)
            gate, up = both[..., 0::2], both[..., 1::2]
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views of [T, 2I]: the op reads them strided
        return getattr(self, self.down_name)(mul(gate, up))


def grouped_max_m(direct: list) -> dict[torch.dtype, int]:
    """Per activation dtype, the rows of one expert below which the grouped call runs its experts: the per-expert
    loop's kernel crossover (bf16: the direct bf16 kernel calls' max_m, where every linear has one and none rounds
    activations to int8; fp32: the AVX2 kernel's dense_threshold), for the dtypes whose grouped op is built here."""
    from quantkit.kernels import int4_cpu, moe_int4

    max_m = {}
    if moe_int4.available(torch.float32):
        max_m[torch.float32] = int4_cpu.dense_threshold(torch.float32)
    bf16 = {d.max_m for d in direct if d is not None and not d.int8_activations}
    if moe_int4.available(torch.bfloat16) and len(bf16) == 1 \
            and all(d is not None and not d.int8_activations for d in direct):
        max_m[torch.bfloat16] = bf16.pop()
    return max_m


class MoEBlock(nn.Module):
    """Router + experts under the family's names (ExpertsSpec): x [T, hidden] -> [T, hidden]."""

    def __init__(self, s: DecoderShape):
        super().__init__()
        spec, moe = s.experts, s.moe
        self.spec, self.moe, self.act = spec, moe, s.act
        setattr(self, spec.router, nn.Linear(s.hidden_size, moe.num_experts, bias=spec.router_bias))
        names = (spec.gate, spec.up, spec.down)
        # gpt-oss: gate and up arrive as one linear, its output rows interleaved
        setattr(self, spec.experts, nn.ModuleList(GatedMLP(s.hidden_size, moe.intermediate, s.act, names,
                                                           spec.gate_up, spec.bias, s.swiglu,
                                                           interleaved=spec.gate_up is not None)
                                                  for _ in range(moe.num_experts)))
        self.grouped: StackedExperts | None = None  # set by stack_experts: every expert in one kernel call

    def stack_experts(self) -> bool:
        """Run each step whose experts all get fewer rows than their kernels' dense crossover through one grouped
        kernel call (kernels/moe_int4.py), where every expert's gate|up (fused) and down are 4-bit linears on
        quantkit's int4 kernel in one layout and the activation is SiLU; each expert then reads its weights from the
        stack. Returns whether it did."""
        from quantkit.kernels import moe_int4
        from quantkit.model.quant_linear import QuantLinear

        experts = getattr(self, self.spec.experts)
        linears = [(e.gate_up_proj, getattr(e, e.down_name)) for e in experts]
        kernels = [m.int4_kernel() if isinstance(m, QuantLinear) else None for pair in linears for m in pair]
        if self.act != "silu" or None in kernels:
            return False
        gate_up, down = [w for w, _ in kernels[0::2]], [w for w, _ in kernels[1::2]]
        if not moe_int4.stackable(gate_up, down):
            return False
        self.grouped = moe_int4.stack_experts(gate_up, down, grouped_max_m([d for _, d in kernels]))
        for e, pair in enumerate(linears):
            for module, view in zip(pair, self.grouped.expert(e)):
                module.point_at(view)
        return True

    def forward(self, x: torch.Tensor, ops=fused_ops_reference) -> torch.Tensor:
        weights, chosen = route(getattr(self, self.spec.router)(x), self.moe.top_k, self.moe.renormalize)
        grouped = self.grouped
        if grouped is not None and grouped.takes(x, chosen):
            return grouped(x, chosen, weights)
        experts = getattr(self, self.spec.experts)
        out = torch.zeros_like(x)
        for b in expert_batches(weights, chosen, self.moe.num_experts):
            y = experts[b.expert](x.index_select(0, b.rows), ops)  # [n, hidden]
            # rows are distinct within an expert: a gather, an add and a scatter, each below torch's parallel grain
            # at decode sizes; index_add_ always enters its parallel loop: 5 us on one thread, 40 ms at 2 threads
            # on a loaded machine (its OpenMP team waiting for a core), 64 times a layer at batch 8
            out[b.rows] += (y * b.weights[:, None]).to(out.dtype)
        return out
