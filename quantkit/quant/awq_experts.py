"""AWQ over an MoE layer's experts (after its attention, quantkit.quant.awq), one expert at a time.

  1. one scale s [hidden] for the MLP norm -> every expert's gate and up (they all read the block's
     input), searched on the block's output: each candidate's error is summed expert by expert,
     sum_e w_e * (expert_e with gate/up at Q(W s)/s  -  expert_e float) over the tokens routed to e,
     so one expert's fake-quantized weights exist at a time; folded into the norm, every expert's
     gate/up columns and the float router's columns (its logits, so the routing, are unchanged);
  2. for each expert: its down's scale searched on its own output (the Gram matrix of its input
     act(gate(x)) * up(x)), folded into its up's rows; a clip per (row, group) of gate, up and down
     searched on samples of their folded inputs; RTN. Each statistic blends the expert's routed
     tokens with the block's prior as GPTQ's Hessians do (quantkit.quant.moe_experts).
Plan keys (format/awq_plan.py), relative to the layer: `<block>.experts.gate_up.scale`,
`<block>.experts.<e>.down.scale`, and each linear's `.clip`.

With the experts streamed (ctx.experts_streamed: not in the layer, each read on its turn), step 1 reads every expert
once per chunk of candidates, each candidate's output error summed into its own [tokens, hidden] buffer, and the
scale is folded into the norm and the router at once, into each expert's gate/up when it is read for step 2. The
choices are the same, bit for bit, as with every expert in the layer (the same operations on each tensor).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from quantkit.format.arch import get_submodule
from quantkit.format.awq_plan import clip_key, gain_key, scale_key
from quantkit.model.moe import expert_batches
from quantkit.quant.awq_apply import fold_scale, scale_columns
from quantkit.quant.awq_search import (
    CLIP_TOKENS, act_mean, choose_scale, linear_output_mse, scale_candidates, scaled_fake_weight, search_scale,
    weight_mean,
)
from quantkit.quant.methods import LayerContext, LayerResult

# the joint scale's candidates judged at once: one [search tokens, hidden] fp32 error buffer each (2048 x 2048:
# 16 MiB, so the default grid's 20 in one pass); more candidates than fit are judged in further passes over the
# experts, each expert read again
JOINT_BUFFER_BYTES = 320 * 2**20


def expected_expert_plan(ctx: LayerContext) -> dict[str, tuple[int, ...]]:
    """The plan keys (relative to the layer) and shapes an MoE layer's quantized experts need."""
    if not ctx.experts:
        return {}
    spec, block = ctx.spec, get_submodule(ctx.layer, ctx.spec.experts.block)
    joint, *downs = spec.expert_awq_groups(block.shape.num_experts)
    shapes = {scale_key(joint.name): (block.router_linear.weight.shape[1],)}
    for g in downs:
        if g.linears[0] in ctx.experts:
            shapes[scale_key(g.name)] = (get_submodule(ctx.layer, g.linears[0]).weight.shape[1],)
    for name in sorted(ctx.experts):
        n, k = get_submodule(ctx.layer, name).weight.shape
        shapes[clip_key(name)] = (n, ctx.scheme.num_groups(k))
        if ctx.config.awq_row_gain:
            shapes[gain_key(name)] = (n,)
    return shapes


def quantize_experts_awq(moe, config, loaded: dict | None, quantize_linear) -> LayerResult:
    """Steps 1 and 2 of the module docstring on `moe` (quantkit.quant.moe_experts.MoEContext); `loaded`: the
    layer's saved plan (--load-plan) instead of searching; `quantize_linear`: awq.quantize_linear."""
    ctx, block = moe.layer, moe.block
    joint, *downs = ctx.spec.expert_awq_groups(block.shape.num_experts)
    result = LayerResult(weights={}, stats={"groups": {}, "clip": {}})
    key = scale_key(joint.name)
    if loaded is None:
        s, result.stats["groups"][joint.name] = _search_joint_scale(moe, config)
    else:
        s = loaded[key]
    result.plan[key] = s = s.detach().float().cpu()
    streamed = ctx.experts_streamed  # then each expert's gate/up take the scale when read, below
    fold_scale(ctx.layer, replace(joint, linears=()) if streamed else joint, s, ctx.model_config,
               ctx.spec.norms.offset, also_scaled=(ctx.spec.experts.router_path,))
    moe.tokens.x = moe.tokens.x / s.to(moe.tokens.x.device)  # the tokens as the folded norm feeds them
    if moe.output is not None:  # the next layer's inputs: on the block's input as the folded layer computes it
        moe.recapture()
    for ex in moe.experts():
        if streamed:
            scale_columns(ctx.layer, ex.inputs, s)
        if downs:  # down's scale folded through up (not where the activation forbids it: gpt-oss)
            down = downs[ex.index]
            dkey = scale_key(down.name)
            if loaded is None:
                s_down, result.stats["groups"][down.name] = _search_down_scale(ctx, ex, config)
            else:
                s_down = loaded[dkey]
            result.plan[dkey] = s_down.detach().float().cpu()
            fold_scale(ctx.layer, down, result.plan[dkey], ctx.model_config)
            result.stats["groups"].setdefault(down.name, {})["tokens"] = ex.routed
        x = ex.sample(CLIP_TOKENS)
        hidden = ex.sample(CLIP_TOKENS, ex.module.hidden)  # down's input, as its folded up now feeds it
        for name, xs in [(n, x) for n in ex.inputs] + [(ex.down, hidden)]:
            quantize_linear(ctx, name, xs, name not in ctx.spec.awq_no_clip, loaded, result.plan,
                            config.awq_grid, result.weights, result.losses, result.stats["clip"])
        moe.expert_done(result, ex.linears)
    return result


def _search_joint_scale(moe, config) -> tuple[torch.Tensor, dict]:
    """The MLP norm's scale [hidden] over every expert's gate/up, judged on the block's output (step 1): each
    candidate's error delta [tokens, hidden] summed expert by expert, the experts visited once per chunk of
    candidates (JOINT_BUFFER_BYTES of deltas at once), each with its float output made on its visit."""
    ctx, block, tokens = moe.layer, moe.block, moe.tokens
    rows = _strided_rows(tokens.x.shape[0], config.awq_search_tokens)
    x, weights, experts = tokens.x[rows], tokens.weights[rows], tokens.experts[rows]
    batches = {b.expert: b for b in expert_batches(weights, experts, block.shape.num_experts)}
    x_mean = act_mean([tokens.x])
    w_mean = _experts_weight_mean(moe) if config.awq_weight_statistic else None
    candidates = scale_candidates(x_mean, w_mean, config.awq_grid, config.awq_duo_scaling)
    per_chunk = max(1, JOINT_BUFFER_BYTES // (x.numel() * x.element_size()))
    losses: list[float] = []
    for first in range(0, len(candidates), per_chunk):
        chunk = candidates[first:first + per_chunk]
        deltas = [torch.zeros_like(x) for _ in chunk]  # [tokens, hidden] each
        for e, _ in moe.visit_experts():
            if (b := batches.get(e)) is not None:
                _add_expert_errors(block.expert_list[e], x[b.rows], b, [c.scale for c in chunk], deltas, ctx.scheme)
        losses += [float(d.pow(2).mean()) for d in deltas]
    choice = choose_scale(candidates, losses)
    return choice.best.scale, choice.stats()


@torch.no_grad()
def _add_expert_errors(ex, xe: torch.Tensor, b, scales: list[torch.Tensor], deltas: list[torch.Tensor],
                       scheme) -> None:
    """Into each delta [tokens, hidden]: the routing weight x (the expert's output with its gate/up at Q(W s) / s
    minus its float output) on its routed rows xe [n, hidden], for each candidate s of `scales`."""
    inputs, down = [getattr(ex, n) for n in ex.inputs], getattr(ex, ex.down_name)
    ref = ex(xe)  # [n, hidden]: its float output
    for s, delta in zip(scales, deltas):
        outs = [torch.nn.functional.linear(xe, scaled_fake_weight(m.weight, s, scheme), m.bias) for m in inputs]
        delta.index_add_(0, b.rows, (down(ex.combine(outs)) - ref) * b.weights[:, None])


def _experts_weight_mean(moe) -> torch.Tensor:
    """Duo scaling's weight statistic over the experts: the mean of each expert's [gate; up] normalized as one group
    would be (weight_mean), each expert read on its visit."""
    ctx = moe.layer
    means = [weight_mean([get_submodule(ctx.layer, n).weight for n in names[:-1]], ctx.scheme)
             for _, names in moe.visit_experts()]
    return torch.stack(means).mean(dim=0)


def _search_down_scale(ctx: LayerContext, ex, config) -> tuple[torch.Tensor, dict]:
    """An expert's down scale [I] from its input act(gate(x)) * up(x) (the float model's: gate/up hold W s and
    the tokens are x / s), judged on its own output through the Gram matrix; both statistics blended from its
    routed tokens and the prior (moe_experts.ExpertWork.blended)."""
    w = get_submodule(ctx.layer, ex.down).weight.data.float()
    gram = ex.blended(lambda z: z.T @ z / z.shape[0], ex.module.hidden)  # [I, I]: the mean of z z^T

    def loss_of(s: torch.Tensor) -> float:
        return linear_output_mse(scaled_fake_weight(w, s.to(w.device), ctx.scheme) - w, gram, 1)

    x_mean = ex.blended(lambda z: z.abs().mean(dim=0), ex.module.hidden)
    w_mean = weight_mean([w], ctx.scheme) if config.awq_weight_statistic else None
    choice = search_scale(scale_candidates(x_mean, w_mean, config.awq_grid, config.awq_duo_scaling), loss_of)
    return choice.best.scale, choice.stats()


def _strided_rows(tokens: int, max_tokens: int) -> torch.Tensor:
    """Evenly strided token rows, at most max_tokens of them (all for max_tokens <= 0), as strided_samples."""
    step = 1 if max_tokens <= 0 or tokens <= max_tokens else -(-tokens // max_tokens)
    return torch.arange(0, tokens, step)

