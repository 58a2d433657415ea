"""A mixture-of-experts block's 4-bit experts in one kernel call (kernels/csrc/moe_int4_cpu.cpp: bf16 activations on the
AVX-512 BF16 kernel, fp32 on the AVX2 one), the experts' weights stacked for it, and the pure-torch reference of what it
computes.

The engine's per-expert loop runs about six torch ops and two kernel calls for every expert that received tokens: 64
experts a layer at batch 8 on Qwen3-30B-A3B's shape, each call too small for two threads to share well. Stacked, one
call routes all of them: tokens sorted by expert, every expert's gate|up in one parallel loop over all experts' row
blocks, SiLU times up, down the same way, and the weighted sum into each token's row (llama.cpp's mul_mat_id and
vLLM's fused_moe group the same way). Its result equals the loop's bit for bit (tests/kernels/test_moe_int4.py).

Stacked layout: the Int4Blocked tensors of each expert under one more leading dimension,
  w1 uint8 [E, ceil(2I/16), H, 8], s1 fp16|fp32 [E, ceil(2I/16), H/g1, 2, 16]    gate|up, fused per expert
  w2 uint8 [E, ceil(H/16), I, 8],  s2 fp16|fp32 [E, ceil(H/16), I/g2, 2, 16]     down
and each expert's own Int4Blocked becomes a view into the stack, so stacking does not double the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.kernels.int4_cpu import Int4Blocked, dequantize_blocked, extension


@dataclass(frozen=True)
class StackedExperts:
    """One MoE layer's experts for the grouped op: gate|up (`w1`, `s1`, groups of `gs1`) and down (`w2`, `s2`, `gs2`)
    stacked over the experts. `max_m`: per activation dtype the op runs (bf16 on the AVX-512 BF16 kernel, fp32 on the
    AVX2 one), the rows of one expert from which a step runs the per-expert loop instead: the loop's dense crossover for
    that dtype, so that both paths run the same kernel on every expert's rows."""

    w1: torch.Tensor
    s1: torch.Tensor
    gs1: int
    w2: torch.Tensor
    s2: torch.Tensor
    gs2: int
    max_m: dict[torch.dtype, int]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    def takes(self, x: torch.Tensor, chosen: torch.Tensor) -> bool:
        """Whether a step on x with the router's choices `chosen` [T, k] runs here: x's dtype has a grouped op and
        every expert gets fewer rows than its max_m (from there the per-expert loop dequantizes tiles). Below max_m
        tokens no count is needed."""
        max_m = self.max_m.get(x.dtype, 0)
        return chosen.shape[0] < max_m or (max_m > 0 and int(torch.bincount(chosen.reshape(-1)).max()) < max_m)

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x bf16 or fp32 [T, H], the router's choices and weights [T, k] -> [T, H] in x's dtype."""
        op = extension().int4_moe_bf16 if x.dtype == torch.bfloat16 else extension().int4_moe_f32
        return op(x, chosen, weights, self.w1, self.s1, self.gs1, self.w2, self.s2, self.gs2)

    def expert(self, e: int) -> tuple[Int4Blocked, Int4Blocked]:
        """Expert e's gate|up and down as Int4Blocked views into the stack."""
        hidden = self.w1.shape[2]
        return (Int4Blocked(self.w1[e], self.s1[e], 2 * self.intermediate, self.gs1, None),
                Int4Blocked(self.w2[e], self.s2[e], hidden, self.gs2, None))


def available(dtype: torch.dtype) -> bool:
    """Whether the grouped op for activations of `dtype` was built for this CPU: fp32 wherever the int4 extension is
    (AVX2 and above), bf16 from AVX-512 BF16."""
    name = {torch.bfloat16: "int4_moe_bf16", torch.float32: "int4_moe_f32"}.get(dtype)
    return name is not None and hasattr(extension(), name)


def stackable(gate_up: list[Int4Blocked], down: list[Int4Blocked]) -> bool:
    """Whether every expert's gate|up and down share one layout the op reads: no act-order permutation, one shape,
    group size and scale dtype for all gate|up and all down, even group sizes, down's input = gate|up's output / 2."""
    def uniform(parts: list[Int4Blocked]) -> bool:
        return len({(p.packed.shape, p.scale_zero.shape, p.scale_zero.dtype, p.group_size, p.out_features)
                    for p in parts}) == 1 and all(p.perm is None and p.group_size % 2 == 0 for p in parts)

    return (len(gate_up) == len(down) > 0 and uniform(gate_up) and uniform(down)
            and 2 * down[0].packed.shape[1] == gate_up[0].out_features
            and down[0].out_features == gate_up[0].packed.shape[1])


def stack_experts(gate_up: list[Int4Blocked], down: list[Int4Blocked], max_m: dict[torch.dtype, int]
                  ) -> StackedExperts:
    """The experts' weights stacked (check `stackable` first); the caller then points each expert at its view."""
    return StackedExperts(torch.stack([p.packed for p in gate_up]), torch.stack([p.scale_zero for p in gate_up]),
                          gate_up[0].group_size, torch.stack([p.packed for p in down]),
                          torch.stack([p.scale_zero for p in down]), down[0].group_size, max_m)


def int4_moe_reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, s: StackedExperts
                       ) -> torch.Tensor:
    """The oracle, in fp32 from the dequantized weights: sum over each token's choices of weight x
    down(silu(gate(x)) * up(x)), returned in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    xf = x.float()
    for e in chosen.unique().tolist():
        w1, w2 = (dequantize_blocked(w) for w in s.expert(e))
        token, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = (xf[token] @ w1.T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2.T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.to(x.dtype)
