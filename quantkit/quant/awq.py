"""AWQ (activation-aware weight quantization) as a LayerMethod, one decoder layer at a time.

For a layer, on the cached calibration inputs, as in the paper and llm-awq:
  1. capture each LinearGroup's input and its inspected module's calls on the float layer;
  2. search a scale per group (the spec's AWQ mappings): s = mean|x|**ratio over a grid of
     ratios, keeping the one whose inspected output is closest to float with the group's
     weights set to Q(W * s) / s (search, on the float weights, for every group first). The
     search runs in fp32 whatever ctx.compute_dtype says: bf16 rounding of the outputs is as
     large as the differences between neighbouring candidates (measured: stories260K 1.0243x
     with a bf16 search against 1.0005x). A group inspected on its own single linear (o, down)
     is judged from its inputs' Gram matrix instead of re-running the tokens;
  3. fold every scale into its feeder (norm weight or feeding linear's rows); under GQA the
     v -> o scale is tied over the query heads sharing a KV head, and v_proj's rows take its
     KV-head part (arch.tie_over_query_heads);
  4. re-capture the (now scaled) inputs and search a clip threshold per (row, group) of each
     quantized linear on a 512-token sample, except the spec's awq_no_clip (none for Llama); clamp;
  5. quantize with RTN (asymmetric by default: ctx.scheme), leave the dequantized weights in
     the layer, and return the plan (scales and clips) for `awq_plan.safetensors`.
With `--load-plan`, steps 2 and 4 read the saved tensors instead of searching.
"""

from __future__ import annotations


import torch

from quantkit.config import QuantizeConfig
from quantkit.format.arch import LinearGroup, get_submodule, head_counts, tie_over_query_heads
from quantkit.quant.awq_apply import apply_clip, fold_reason, fold_scale
from quantkit.quant.awq_experts import expected_expert_plan, quantize_experts_awq
from quantkit.quant.awq_capture import Capture, capture, merge_calls, strided_samples
from quantkit.format.awq_plan import PlanFile, clip_key, gain_key, scale_key
from quantkit.quant.awq_search import (
    CLIP_TOKENS, act_mean, clip_sample, fake_quantize, output_error, scaled_fake_weight, search_clip,
    fitted_row_gain, scale_candidates, search_scale, weight_mean, with_row_gain,
)
from quantkit.quant.methods import LayerContext, LayerResult
from quantkit.format.primitives import rtn_quantize


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _mse(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """Mean squared error over every element of every sample."""
    err = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(outs, refs))
    return err / sum(r.numel() for r in refs)


class AWQMethod:
    """The `awq` LayerMethod (see quantkit.quant.methods for the contract)."""

    name = "awq"
    needs_calibration = True
    needs_float_stream = False
    def __init__(self, config: QuantizeConfig):
        self.config = config
        # an MoE layer's experts read one at a time (quantkit.quant.awq_experts), except where the next layer takes
        # the float layer's outputs (--awq-next-inputs float): those need every float expert in the layer
        self.streams_experts = config.awq_next_inputs != "float"
        self._plan_file: PlanFile | None = None
        self._layer_plan: dict[str, torch.Tensor] | None = None  # the loaded plan of the layer being quantized

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        quantized = [n for n in ctx.linears if n not in ctx.skipped]
        groups, skipped_groups = self._scaled_groups(ctx, quantized)
        expected = {**self._expected_plan(ctx, groups, quantized), **expected_expert_plan(ctx)}
        loaded = self._layer_plan = self._load_layer_plan(ctx, expected)
        search_inputs = strided_samples(ctx.inputs, self.config.awq_search_tokens)
        # one float run gives each group's input (scale statistics, clip samples) and, unless the
        # search runs on a subset, the inspected modules' calls
        run = _compared_run(ctx)
        cap = capture(ctx, _input_groups(ctx, quantized), inspect=loaded is None and search_inputs is ctx.inputs,
                      run=run)
        if loaded is None and search_inputs is not ctx.inputs:  # the candidates are judged on a subset
            cap.calls = capture(ctx, groups, inspect=True, keep=lambda x: None, inputs=search_inputs, run=run).calls
        loss_rtn = self._rtn_block_loss(ctx, quantized, cap.outputs, run)
        stats: dict = {"skipped_groups": skipped_groups, "groups": {}}
        plan: dict[str, torch.Tensor] = {}
        for g in groups:
            key = scale_key(g.name)
            if loaded is None:
                s, stats["groups"][g.name] = self._search_group(ctx, g, quantized, cap)
            else:
                s = loaded[key]
                stats["groups"][g.name] = _scale_stats(s)
            plan[key] = s.detach().float().cpu()
        for g in groups:
            fold_scale(ctx.layer, g, plan[scale_key(g.name)], ctx.model_config, ctx.spec.norms.offset)
        weights, losses, clip_stats = self._clip_and_quantize(ctx, quantized, loaded, plan, cap)
        stats["clip"] = clip_stats
        stats["loss_rtn"] = loss_rtn
        outputs = run()
        stats["loss_awq"] = _mse(outputs, cap.outputs)
        if ctx.experts_streamed:  # the losses are the MoE block's input's; the experts' step makes the outputs
            stats["loss_at"] = f"{ctx.spec.experts.block} input"
            return LayerResult(weights=weights, losses=losses, stats=stats, plan=plan)
        floats = self.config.awq_next_inputs == "float"
        return LayerResult(weights=weights, losses=losses, stats=stats, plan=plan,
                           outputs=cap.outputs if floats else outputs, outputs_are_float=floats)

    def quantize_experts(self, moe) -> LayerResult:
        """An MoE layer's experts after quantize_layer (quantkit.quant.awq_experts), with the plan loaded for the
        layer, if any."""
        return quantize_experts_awq(moe, self.config, self._layer_plan, quantize_linear)

    # ---- which groups are scaled, and what a plan must hold -------------------------------------

    def _scaled_groups(self, ctx: LayerContext, quantized: list[str]) -> tuple[list[LinearGroup], dict[str, str]]:
        groups, skipped = [], {}
        for g in ctx.spec.groups:
            reason = None
            if not any(n in quantized for n in g.linears):
                reason = f"{', '.join(g.linears)} left float, nothing to scale"
            else:
                reason = fold_reason(ctx.layer, g, ctx.model_config)
            if reason is None:
                groups.append(g)
            else:
                skipped[g.name] = reason
        return groups, skipped

    def _expected_plan(self, ctx: LayerContext, groups: list[LinearGroup],
                       quantized: list[str]) -> dict[str, tuple[int, ...]]:
        shapes = {scale_key(g.name): (get_submodule(ctx.layer, g.linears[0]).weight.shape[1],) for g in groups}
        for name in _clipped(ctx, quantized):
            n, k = get_submodule(ctx.layer, name).weight.shape
            shapes[clip_key(name)] = (n, ctx.scheme.num_groups(k))
        if self.config.awq_row_gain:
            shapes.update({gain_key(name): (get_submodule(ctx.layer, name).weight.shape[0],) for name in quantized})
        return shapes

    def _load_layer_plan(self, ctx: LayerContext, expected) -> dict[str, torch.Tensor] | None:
        if self.config.load_plan is None:
            return None
        if self._plan_file is None:
            self._plan_file = PlanFile(self.config.load_plan)
            num_layers = getattr(ctx.model_config, "num_hidden_layers", None)
            if num_layers is not None:
                self._plan_file.check_layer_count(num_layers)
        return self._plan_file.layer(ctx.index, expected)

    # ---- search -----------------------------------------------------------------------------

    def _search_group(self, ctx: LayerContext, g: LinearGroup, quantized: list[str],
                      cap: Capture) -> tuple[torch.Tensor, dict]:
        """The best scale [K] of one group, and its statistics for quantkit_meta.json."""
        linears = [get_submodule(ctx.layer, n) for n in g.linears if n in quantized]
        originals = [lin.weight.data for lin in linears]
        calls = merge_calls(cap.calls[g.inspect])
        if g.inspects_its_linear:  # the error of one linear: a quadratic form in its inputs' Gram matrix
            w = originals[0].float()
            error = output_error([a[0] if a else kw["input"] for a, kw in calls])

            def loss_of(s: torch.Tensor) -> float:
                return error(scaled_fake_weight(w, s.to(w.device), ctx.scheme) - w)
        else:
            loss_of = self._module_loss(ctx, g, linears, originals, calls)
        x_mean = act_mean(cap.inputs[g.name]).to(originals[0].device)
        w_mean = weight_mean(originals, ctx.scheme) if self.config.awq_weight_statistic else None
        if g.feeder_repeats_kv:  # GQA v -> o: one scale per KV-head channel, shared by its query heads
            heads, kv_heads = head_counts(ctx.model_config)
            x_mean = tie_over_query_heads(x_mean, heads, kv_heads)
            w_mean = None if w_mean is None else tie_over_query_heads(w_mean, heads, kv_heads)
        choice = search_scale(scale_candidates(x_mean, w_mean, self.config.awq_grid, self.config.awq_duo_scaling),
                              loss_of)
        return choice.best.scale, {**_scale_stats(choice.best.scale), **choice.stats()}

    @staticmethod
    def _module_loss(ctx: LayerContext, g: LinearGroup, linears, originals, calls):
        """loss_of(s): the inspected module's output error, re-run with the group's weights at Q(W s) / s."""
        module = get_submodule(ctx.layer, g.inspect)
        with torch.no_grad():
            refs = [_first(module(*a, **kw)).float() for a, kw in calls]

        def loss_of(s: torch.Tensor) -> float:
            try:
                for lin, w in zip(linears, originals):
                    lin.weight.data = scaled_fake_weight(w, s.to(w.device), ctx.scheme).to(w.dtype)
                with torch.no_grad():
                    return _mse([_first(module(*a, **kw)) for a, kw in calls], refs)
            finally:
                for lin, w in zip(linears, originals):
                    lin.weight.data = w
        return loss_of

    # ---- clip and quantize --------------------------------------------------------------------

    def _clip_and_quantize(self, ctx: LayerContext, quantized: list[str], loaded, plan: dict, cap: Capture):
        """Clip (searched or loaded) then RTN-quantize each linear; per-linear output losses.

        The clip sample of a group is its captured float input divided by the group's scale: once
        the scales are folded, the float layer feeds each group exactly x / s (every fold keeps
        the layer's function), so no second run of the layer is needed."""
        by_linear = {n: g for g in ctx.spec.groups for n in g.linears}
        tokens = sum(x.shape[:-1].numel() for x in ctx.inputs)
        step = max(1, tokens // CLIP_TOKENS)
        samples = {}  # group -> [<= CLIP_TOKENS, K]
        for name, xs in cap.inputs.items():
            x = clip_sample([t.reshape(-1, t.shape[-1])[::step] for t in xs])
            s = plan.get(scale_key(name))
            samples[name] = x if s is None else x / s.to(x.device)
        weights, losses, clip_stats = {}, {}, {}
        clipped = set(_clipped(ctx, quantized))
        for name in quantized:
            quantize_linear(ctx, name, samples[by_linear[name].name], name in clipped, loaded, plan, self.config.awq_grid,
                            weights, losses, clip_stats)
        return weights, losses, clip_stats

    def _rtn_block_loss(self, ctx: LayerContext, quantized: list[str], refs: list[torch.Tensor], run) -> float:
        """Block output MSE with plain RTN on the same linears (the 'before AWQ' figure); `run`: _compared_run's."""
        linears = [get_submodule(ctx.layer, n) for n in quantized]
        originals = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, originals):
                lin.weight.data = fake_quantize(w, ctx.scheme).to(w.dtype)
            return _mse(run(), refs)
        finally:
            for lin, w in zip(linears, originals):
                lin.weight.data = w


def quantize_linear(ctx: LayerContext, name: str, x: torch.Tensor, clip: bool, loaded: dict | None, plan: dict,
                    grid: int, weights: dict, losses: dict, clip_stats: dict) -> None:
    """One linear of the layer (its scale already folded): clip (searched on x [T, K], the linear's input as the
    folded layer feeds it, or loaded; not where `clip` is False or a loaded plan has none), RTN-quantize, each
    output row's scales times its least-squares gain on x (awq_search.with_row_gain; `awq_row_gain`), leave the
    dequantized weight in place; the integer weight, output loss and clip ratio into the dicts."""
    lin = get_submodule(ctx.layer, name)
    x = x.to(lin.weight.device)
    w = lin.weight.data.float()
    key = clip_key(name)
    if clip and (loaded is None or key in loaded):
        max_val = loaded[key] if loaded is not None else search_clip(w, x, ctx.scheme, grid)
        plan[key] = max_val.detach().float().cpu()
        apply_clip(lin, plan[key])
        org_max = _group_abs_max(w, max_val.shape[1])
        clip_stats[name] = float((max_val.to(w.device) / org_max.clamp(min=1e-12)).mean())
    qw = rtn_quantize(lin.weight.data, ctx.scheme)
    gain = None if not ctx.config.awq_row_gain else fitted_row_gain(qw, x.float(), w) if loaded is None \
        else loaded.get(gain_key(name))  # (absent from a plan saved before gains: none)
    if gain is not None:
        plan[gain_key(name)] = gain.detach().float().cpu()
        qw = with_row_gain(qw, plan[gain_key(name)])
    w_hat = qw.dequantize().to(lin.weight.device)
    lin.weight.data = w_hat.to(lin.weight.dtype)
    weights[name] = qw
    losses[name] = float((x @ w_hat.T - x @ w.T).pow(2).mean())


def _compared_run(ctx: LayerContext):
    """run(inputs=None): what AWQ compares a layer's runs on, the layer's outputs; with an MoE layer's experts
    streamed (not in the layer until their step), the MoE block's input, where every run then stops (the experts'
    step judges the block's output itself)."""
    if ctx.experts_streamed:
        return lambda inputs=None: ctx.run_until(ctx.spec.experts.block, inputs)
    return ctx.run_layer


def _clipped(ctx: LayerContext, quantized: list[str]) -> list[str]:
    """The quantized linears whose clip is searched (the spec's awq_no_clip are quantized unclipped)."""
    return [n for n in quantized if n not in ctx.spec.awq_no_clip]


def _group_abs_max(w: torch.Tensor, num_groups: int) -> torch.Tensor:
    n, k = w.shape
    return w.abs().reshape(n, num_groups, k // num_groups).amax(dim=-1)


def _scale_stats(s: torch.Tensor) -> dict:
    s = s.float()
    return {"scale_min": float(s.min()), "scale_max": float(s.max()), "scale_mean": float(s.mean())}


__all__ = ["AWQMethod", "Capture", "capture", "merge_calls"]


def _input_groups(ctx: LayerContext, quantized: list[str]) -> list[LinearGroup]:
    """The spec groups with a linear to quantize (each needs its input captured), in layer order."""
    return [g for g in ctx.spec.groups if any(n in quantized for n in g.linears)]
