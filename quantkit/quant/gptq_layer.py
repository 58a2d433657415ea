"""GPTQ over one decoder layer: Hessians from forward hooks, groups quantized in order.

With GPTAQ (--gptaq: asymmetric calibration, Li et al., ICML 2025) each linear's target is the float model's output:
the layer keeps a float twin (a copy taken before any solve, run on the float model's inputs), each Hessian comes with
the cross term D = (X - X~) X~^T of the twin's inputs X and the layer's X~ on the same tokens, and GPTQ solves for
the target weight W + alpha W D H^-1 (quantkit.quant.gptaq.asymmetric_target). The twin's outputs are the float
model's inputs to the next layer."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch

from quantkit.config import QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.format.arch import get_submodule
from quantkit.quant.capture import fold_linear_inputs, fold_paired_linear_inputs
from quantkit.quant.gptaq import accumulate_cross, cross_weight, target_from_cross
from quantkit.quant.gptq import GPTQOptions, accumulate_hessian, empty_hessian, gptq_quantize, split_rows
from quantkit.quant.methods import LayerContext, LayerResult


class GPTQMethod:
    name = "gptq"
    needs_calibration = True
    streams_experts = True  # each expert's Hessians and solve need only its own weights

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg
        self.needs_float_stream = cfg.gptaq
        self.opts = GPTQOptions(damp=cfg.damp, block_size=cfg.block_size, act_order=cfg.desc_act,
                                act_group_aware=cfg.act_group_aware, static_groups=cfg.static_groups,
                                scale_search=cfg.scale_search)

    def sequential_groups(self, ctx: LayerContext) -> list[list[str]]:
        """Linears sharing an input, in the order the layer computes them (true-sequential);
        or all at once when true-sequential is off."""
        groups = [[n for n in g.linears if n in ctx.linears] for g in ctx.spec.groups]
        groups = [g for g in groups if g]
        return groups if self.cfg.true_sequential else [[n for g in groups for n in g]]

    def quantize_layer(self, ctx: LayerContext) -> LayerResult:
        """Every group's linears solved; a solved linear's dequantized weight goes back into the layer only before the
        layer runs again (true-sequential) or at the end: until then its integer weight (a byte a weight) stands for
        it, so the layer's later solves (an 8B model's down_proj, the largest) do not have the earlier linears beside
        them in fp32 (0.6 GiB at that shape)."""
        result = LayerResult(weights={})
        solved: list[str] = []
        twin = _float_twin(ctx)  # GPTAQ: the float layer on the float model's inputs; else None
        for names in self.sequential_groups(ctx):
            _dequantize_into_layer(ctx, result, solved)
            statistics = self._collect_statistics(ctx, twin, names)
            for stack in _shared_input_stacks(ctx, names):  # each Hessian let go once its linears are solved
                self._quantize_stack(ctx, stack, result, statistics, dequantize=False)
                solved += stack
        _dequantize_into_layer(ctx, result, solved)
        if twin is not None:
            result.float_outputs = twin.run_layer()
        return result

    def quantize_experts(self, moe) -> LayerResult:
        """Each expert in turn (quantkit.quant.moe_experts.MoEContext): gate/up stacked on the Hessian of the
        tokens routed to it (with the block's prior), then down on act(gate(x)) * up(x) with gate/up quantized
        (true-sequential, as the dense MLP), each Hessian dropped before the next is made."""
        ctx = moe.layer
        result = LayerResult(weights={})
        for ex in moe.experts():
            for stack, through in ((list(ex.inputs), None), ([ex.down], ex.module.hidden)):  # down after gate/up
                self._quantize_stack(ctx, stack, result, dict.fromkeys(stack, (ex.hessian(through), None)))
            moe.expert_done(result, ex.linears)
        return result

    def _quantize_stack(self, ctx: LayerContext, names: list[str], result: LayerResult, statistics: dict,
                        dequantize: bool = True) -> None:
        """GPTQ on the linears `names`, which read one input (one H): their rows stacked and quantized
        in one pass (rows are independent given H), so the column loop and the Cholesky run once.

        H is taken here from `statistics` (name -> (H, cross term D or None), as _collect_statistics' makes them) with D
        where GPTAQ made one: taken here, this frame holds their only references, so D goes once GPTAQ's target no
        longer needs it. H and the
        weights are handed over: gptq_quantize holds the only references (H's storage receives its factor, the
        weights are worked on in place), and the linears hold no weight until theirs is dequantized back
        (now, or with `dequantize=False` by _dequantize_into_layer before the layer runs again). With D, GPTQ solves
        for the asymmetric target instead of the weights themselves."""
        h, cross = _take(statistics, names)
        linears = [get_submodule(ctx.layer, n) for n in names]
        start = time.perf_counter()
        sizes = [lin.weight.shape[0] for lin in linears]
        try:
            w = _hand_over(linears)
            if cross is not None:  # GPTAQ's target; D let go before H's factor is made (quantkit.quant.gptaq)
                wd = cross_weight(w, cross, self.opts.factor_dtype)
                del cross
                w = target_from_cross(w, h, wd, self.cfg.gptaq_alpha, self.opts.damp, self.opts.max_damp_retries,
                                      self.opts.factor_dtype)
                del wd
            r = gptq_quantize(w, h, ctx.scheme, self.opts, consume_h=True, consume_w=True)
        except ArithmeticError as exc:
            raise QuantkitError(f"layer {ctx.index} {', '.join(names)}: {exc}") from exc
        del h
        row_losses = r.row_losses.split(sizes)
        result.stats.setdefault("seconds", {})["+".join(names)] = round(time.perf_counter() - start, 4)
        for name, lin, qw, loss in zip(names, linears, split_rows(r.weight, sizes), row_losses):
            if dequantize:
                lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            result.weights[name] = qw
            result.losses[name] = float(loss.sum())
            if r.damp != self.opts.damp:
                result.stats.setdefault("damp_raised", {})[name] = r.damp

    def _collect_statistics(self, ctx: LayerContext, twin: LayerContext | None, names: list[str]
                            ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Run the layer on the calibration inputs; per distinct input tensor its Hessian, and with GPTAQ's float
        `twin` (run on the same tokens) the cross term D, else None.

        Each run stops as soon as the last hooked linear has its input: the rest of the layer
        (e.g. attention and MLP after q/k/v's input) would not change these statistics."""
        if twin is None:
            def update(state, x):
                h, n = state or (empty_hessian(x.shape[-1], x.device), 0)
                return accumulate_hessian(h, n, x)

            return {n: (hn[0], None) for n, hn in fold_linear_inputs(ctx, names, update).items()}

        def paired(state, x_float, x_quant):
            h, d, n = state or (empty_hessian(x_quant.shape[-1], x_quant.device),
                                empty_hessian(x_quant.shape[-1], x_quant.device), 0)
            accumulate_cross(d, n, x_float, x_quant)  # before H's update: both scaled by the same n
            h, n = accumulate_hessian(h, n, x_quant)
            return h, d, n

        return {n: (hdn[0], hdn[1]) for n, hdn in fold_paired_linear_inputs(ctx, twin, names, paired).items()}


def _hand_over(linears: list[torch.nn.Module]) -> torch.Tensor:
    """The linears' weights stacked [sum N, K] (one linear's: its own tensor), each linear left holding an empty
    placeholder of its dtype, so that the caller's argument is the weights' last reference."""
    w = torch.cat([lin.weight.data for lin in linears]) if len(linears) > 1 else linears[0].weight.data
    for lin in linears:
        lin.weight.data = torch.empty(0, dtype=lin.weight.dtype, device=lin.weight.device)
    return w


def _dequantize_into_layer(ctx: LayerContext, result: LayerResult, names: list[str]) -> None:
    """Each of `names` (solved, its integer weight in `result`) gets its dequantized weight back; `names` emptied."""
    for name in names:
        lin = get_submodule(ctx.layer, name)
        lin.weight.data = result.weights[name].dequantize().to(lin.weight.dtype)
    names.clear()


def _take(statistics: dict[str, tuple], stack: list[str]) -> tuple:
    """The statistics (Hessian, cross term or None) of the linears `stack` (one shared input), removed from
    `statistics` under each of their names: the caller's are then the last references (an 8B model's down_proj's
    Hessian is 0.77 GiB, not to be held through the solves that follow)."""
    taken = statistics.pop(stack[0])
    for name in stack[1:]:
        statistics.pop(name)
    return taken


def _float_twin(ctx: LayerContext) -> LayerContext | None:
    """GPTAQ's float layer (a copy of ctx.layer before any of it is quantized) on the float model's inputs; None
    without a float stream. Its linears are held in the compute dtype: autocast would cast their fp32 weights (and
    biases) to it in every pass anyway, so the runs are the same to the bit and the copy is half the size (0.43 GiB
    less at an 8B layer); norms and the rest stay fp32, as autocast leaves them."""
    if ctx.float_inputs is None:
        return None
    twin = copy.deepcopy(ctx.layer)
    if ctx.compute_dtype != torch.float32:
        for module in twin.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(ctx.compute_dtype)
    return replace(ctx, layer=twin, inputs=ctx.float_inputs, float_inputs=None)


def _shared_input_stacks(ctx: LayerContext, names: list[str]) -> list[list[str]]:
    """`names` split by the spec group (shared input) each belongs to, in the layer's order."""
    stacks = [[n for n in g.linears if n in names] for g in ctx.spec.groups]
    return [stack for stack in stacks if stack]
