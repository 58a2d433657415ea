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
"""

from __future__ import annotations

import torch

from quantkit.format.arch import get_submodule
from quantkit.format.awq_plan import clip_key, scale_key
from quantkit.model.moe import expert_batches
from quantkit.quant.awq_apply import fold_scale
from quantkit.quant.awq_search import (
    CLIP_TOKENS, act_mean, linear_output_mse, scale_candidates, scaled_fake_weight, search_scale, weight_mean,
)
from quantkit.quant.methods import LayerContext, LayerResult


def expected_expert_plan(ctx: LayerContext) -> dict[str, tuple[int, ...]]:
    """The plan keys (relative to the layer) and shapes an MoE layer's quantized experts need."""
    if not ctx.experts:
        return {}
    spec, block = ctx.spec, get_submodule(ctx.layer, ctx.spec.experts.block)
    joint, *downs = spec.expert_awq_groups(block.shape.num_experts)
    shapes = {scale_key(joint.name): (block.router.weight.shape[1],)}
    for g in downs:
        if g.linears[0] in ctx.experts:
            shapes[scale_key(g.name)] = (get_submodule(ctx.layer, g.linears[0]).weight.shape[1],)
    for name in sorted(ctx.experts):
        n, k = get_submodule(ctx.layer, name).weight.shape
        shapes[clip_key(name)] = (n, ctx.scheme.num_groups(k))
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
    result.plan[key] = s.detach().float().cpu()
    fold_scale(ctx.layer, joint, result.plan[key], ctx.model_config, ctx.spec.norms.offset,
               also_scaled=(ctx.spec.experts.router_path,))
    s = result.plan[key]
    moe.tokens.x = moe.tokens.x / s.to(moe.tokens.x.device)  # the tokens as the folded norm feeds them
    for ex in moe.experts():
        down = downs[ex.index]
        dkey = scale_key(down.name)
        if loaded is None:
            s_down, result.stats["groups"][down.name] = _search_down_scale(ctx, ex, config)
        else:
            s_down = loaded[dkey]
        result.plan[dkey] = s_down.detach().float().cpu()
        fold_scale(ctx.layer, down, result.plan[dkey], ctx.model_config)
        x = ex.sample(CLIP_TOKENS)
        hidden = ex.sample(CLIP_TOKENS, ex.module.hidden)  # down's input, as its folded up now feeds it
        for name, xs in ((ex.gate, x), (ex.up, x), (ex.down, hidden)):
            quantize_linear(ctx, name, xs, name not in ctx.spec.awq_no_clip, loaded, result.plan,
                            config.awq_grid, result.weights, result.losses, result.stats["clip"])
        result.stats["groups"].setdefault(down.name, {})["tokens"] = ex.routed
        moe.expert_done(result, ex.linears)
    return result


def _search_joint_scale(moe, config) -> tuple[torch.Tensor, dict]:
    """The MLP norm's scale [hidden] over every expert's gate/up, judged on the block's output (step 1)."""
    ctx, block, tokens = moe.layer, moe.block, moe.tokens
    rows = _strided_rows(tokens.x.shape[0], config.awq_search_tokens)
    x, weights, experts = tokens.x[rows], tokens.weights[rows], tokens.experts[rows]
    batches = [b for b in expert_batches(weights, experts, block.shape.num_experts)
               if all(n in moe.quantized for n in ctx.spec.experts.linears_of(b.expert))]
    with torch.no_grad():
        refs = [block.expert_list[b.expert](x[b.rows]) for b in batches]  # float outputs, [n_e, H] each

    def loss_of(s: torch.Tensor) -> float:
        delta = torch.zeros_like(x)
        with torch.no_grad():
            for b, ref in zip(batches, refs):
                ex = block.expert_list[b.expert]
                gate, up, down = (getattr(ex, n) for n in ex.names)
                xe = x[b.rows]
                g = xe @ scaled_fake_weight(gate.weight, s, ctx.scheme).T
                u = xe @ scaled_fake_weight(up.weight, s, ctx.scheme).T
                delta.index_add_(0, b.rows, (down(ex.act(g) * u) - ref) * b.weights[:, None])
        return float(delta.pow(2).mean())

    x_mean = act_mean([tokens.x])
    w_mean = None
    if config.awq_weight_statistic:  # the experts' mean, each expert's [gate; up] normalized as one group would be
        means = [weight_mean([get_submodule(ctx.layer, n).weight for n in ctx.spec.experts.linears_of(e)[:2]],
                             ctx.scheme) for e, _ in moe.expert_linears()]
        w_mean = torch.stack(means).mean(dim=0)
    choice = search_scale(scale_candidates(x_mean, w_mean, config.awq_grid, config.awq_duo_scaling), loss_of)
    return choice.best.scale, choice.stats()


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

