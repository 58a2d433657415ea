"""The experts of a mixture-of-experts layer, quantized one at a time (after the layer's attention).

  capture the MoE block's input on every calibration token (the layer re-run with the attention
  already quantized, stopped at the block) -> the float router's choices for each token
  -> for each expert in turn: the tokens routed to it -> the method quantizes its gate/up, then
     its down on act(gate(x)) * up(x) with gate/up already quantized -> its Hessians are dropped.

Memory: the layer's dense weights, the block's input [T, hidden] fp32, the prior's [H, H] Hessian (shared
by every expert's gate/up), and one expert at a time: its statistics (GPTQ: one [H, H] and one [I, I]
Hessian) and, for a method that streams experts (RTN, GPTQ: `streams_experts`), its weights too. The
pipeline then leaves the experts out of the layer it loads (`streamed_expert_linears`) and hands a
loader: each expert's linears are read on its turn, and let go once the method is done with them, after
their share of the block's output on the calibration tokens (routing weight x the expert's output with
its weights quantized) is added to `MoEContext.output`; the layer's re-run that feeds the next layer takes
the block's output from there (`replay_layer`). AWQ streams them too: its joint scale of every expert's gate/up is
judged over passes that read each expert on a visit (`visit_experts`); only with --awq-next-inputs float (the float
layer's outputs feed the next layer) are the experts loaded with the layer. Nor does a layer's integer weights wait
all together: the method hands each expert's on when it is done with it (`MoEContext.expert_done`) to the
pipeline's sink, which packs and writes them then (as uint8 codes, a layer's took 0.6 GB on
Qwen3-30B-A3B's shape, packed 0.3 GB).

Each expert's statistics come from the tokens routed to it, with a prior: GPTQ's Hessian of a
linear of input width K is (n H_routed + K H_prior) / (n + K), H_prior that of an evenly strided
sample of every token of the block (`PRIOR_TOKENS`, routed anywhere), worth K pseudo-tokens. An
expert with n >> K tokens keeps its own statistics; one the router starves (n near 0, whose routed
Hessian is singular noise) falls back on the block's. Measured on real trained MLPs and their inputs
with a simulated router (`python benchmarks/moe_starved.py`, docs/BENCHMARKS.md, "MoE: experts
with few tokens"): better than the routed tokens alone at every count tried (8 to 1024 tokens),
than RTN (which the routed Hessian loses to below ~128), and from 32 tokens on than every token's
Hessian for all experts (llm-compressor's "calibrate all experts"; within 2% of it below). AWQ
blends its statistics (mean |x|, Gram matrix, clip samples) with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from quantkit.format.arch import ExpertsSpec, get_submodule
from quantkit.format.primitives import QuantizedWeight
from quantkit.model.moe import ExpertBatch, SparseMoeBlock, as_block_output, expert_batches
from quantkit.quant.gptq import accumulate_hessian, empty_hessian
from quantkit.quant.methods import LayerContext, LayerResult

# receives an expert's final integer weights (names relative to the layer); the pipeline packs and writes them
ExpertSink = Callable[[dict[str, QuantizedWeight]], None]
# reads these linears' weights (names relative to the layer) from the checkpoint into the layer, in fp32
ExpertLoader = Callable[[tuple[str, ...]], None]

PRIOR_TOKENS = 2048  # the block's tokens (evenly strided) whose statistics are every expert's prior
CHUNK_TOKENS = 4096  # tokens per pass when a statistic is accumulated over many tokens


class _HaveBlockInput(Exception):
    """Raised by the block's pre-hook: the rest of the layer is not needed."""


@dataclass
class RoutedTokens:
    """The MoE block's input on the calibration tokens and the float router's choices for them."""

    x: torch.Tensor  # [T, hidden] fp32
    weights: torch.Tensor  # [T, top_k] fp32
    experts: torch.Tensor  # [T, top_k] int64
    runs: tuple[int, ...] = ()  # tokens of each run of the layer, in order (they sum to T); () for one run


def run_sizes(ctx: LayerContext) -> tuple[int, ...]:
    """Tokens of each of the layer's calibration runs (ctx.inputs), in order."""
    return tuple(x.shape[0] * x.shape[1] for x in ctx.inputs)


def run_bounds(runs: tuple[int, ...], total: int) -> list[tuple[int, int]]:
    """(start, end) token rows of each run; one run of `total` rows for ()."""
    if not runs:
        return [(0, total)]
    ends = torch.tensor(runs).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def streamed_expert_linears(spec: ExpertsSpec, num_experts: int, quantized: frozenset[str]) -> frozenset[str]:
    """The expert linears a layer loads only on their expert's turn: every expert's, when every expert's linears are
    all quantized (an expert left float, even in part, must be in the layer for its re-run: then none)."""
    names = [spec.linears_of(e) for e in range(num_experts)]
    if not names or not all(n in quantized for linears in names for n in linears):
        return frozenset()
    return frozenset(n for linears in names for n in linears)


def prior_weight(routed: int, width: int) -> float:
    """The prior's share of an expert's statistic for an input of `width` channels: K / (n + K)."""
    return width / (routed + width)


@dataclass
class ExpertWork:
    """One expert's turn: its linears (names relative to the layer), the tokens routed to it and the prior's
    tokens, and its statistics blended from the two (see the module docstring)."""

    index: int
    inputs: tuple[str, ...]  # the linears reading the block's input: gate and up (gpt-oss: the one gate_up)
    down: str
    module: torch.nn.Module  # quantkit.model.moe.Expert
    x: torch.Tensor  # [n, hidden] fp32: the tokens routed to it
    prior: torch.Tensor  # [p, hidden] fp32: an evenly strided sample of every token of the block
    layer: LayerContext
    input_prior: Callable[[], torch.Tensor] | None = None  # the prior's Hessian of x [hidden, hidden], shared

    @property
    def routed(self) -> int:
        return self.x.shape[0]

    @property
    def linears(self) -> tuple[str, ...]:
        return (*self.inputs, self.down)

    def hessian(self, through: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """GPTQ's Hessian [K, K] of z = through(x) (x itself without): (n H_routed + K H_prior) / (n + K)."""
        if through is None and self.input_prior is not None:  # the same for every expert: made once a layer
            h = self.input_prior().clone()
        else:
            h = self.layer_gram(self.prior, through)
        w = prior_weight(self.routed, h.shape[0])
        if self.routed:
            h.mul_(w).add_(self.layer_gram(self.x, through), alpha=1 - w)
        return h

    def layer_gram(self, x: torch.Tensor, through=None) -> torch.Tensor:
        return gram(self.layer, x, through)

    def blended(self, stat: Callable[[torch.Tensor], torch.Tensor], through=None) -> torch.Tensor:
        """A per-token mean `stat` of z = through(x) (over [n, K] -> any shape), blended as the Hessian is."""
        with torch.no_grad(), self.layer.autocast():
            prior = self.prior if through is None else through(self.prior).float()
            own = self.x if through is None else through(self.x).float()
        w = prior_weight(self.routed, prior.shape[1])
        out = stat(prior) * w
        return out + stat(own) * (1 - w) if self.routed else out

    def sample(self, tokens: int, through=None) -> torch.Tensor:
        """About `tokens` rows of z = through(x), routed and prior ones in the blend's proportions: [<= tokens, K]."""
        with torch.no_grad(), self.layer.autocast():
            width = self.x.shape[1] if through is None else through(self.x[:1]).shape[1]
            own = round(tokens * (1 - prior_weight(self.routed, width)))
            parts = [_strided(self.x, own), _strided(self.prior, tokens - own)]
            z = torch.cat([p for p in parts if p.shape[0]])
            return z if through is None else through(z).float()


def _strided(x: torch.Tensor, count: int) -> torch.Tensor:
    """min(count, rows) evenly spaced rows of x (all of them where it has no more)."""
    if count >= x.shape[0]:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, max(count, 0)).long()]


def gram(ctx: LayerContext, x: torch.Tensor, through: Callable[[torch.Tensor], torch.Tensor] | None = None
         ) -> torch.Tensor:
    """GPTQ's H = 2/n sum_t z_t z_t^T [K, K] fp32 of z = through(x) (x itself without), in chunks of tokens."""
    h, n = None, 0
    with torch.no_grad(), ctx.autocast():
        for start in range(0, x.shape[0], CHUNK_TOKENS):
            z = x[start:start + CHUNK_TOKENS]
            z = z if through is None else through(z)
            if h is None:
                h = empty_hessian(z.shape[-1], z.device)
            h, n = accumulate_hessian(h, n, z)
    return h


@dataclass
class MoEContext:
    """What a method's `quantize_experts` sees: the layer, its MoE block, and (for calibrated methods) the
    routed calibration tokens."""

    layer: LayerContext
    block: SparseMoeBlock
    block_path: str  # relative to the layer
    quantized: frozenset[str]  # expert linears to quantize (relative to the layer); the others stay float
    tokens: RoutedTokens | None = None
    prior_tokens: int = PRIOR_TOKENS
    sink: ExpertSink | None = None  # without one, every expert's weights stay in the method's result
    loader: ExpertLoader | None = None  # with one, each expert is loaded on its turn and let go after it
    output: torch.Tensor | None = None  # [T, hidden]: the block's output on tokens.x, summed as experts are let go
    # what `output` is computed on, where a method changed how the layer feeds the block (AWQ's fold): the block's
    # input and routing as the layer computes them now, and its tokens by expert (recapture); None: `tokens`
    output_tokens: RoutedTokens | None = None
    _by_expert: dict[int, ExpertBatch] | None = field(default=None, init=False, repr=False)
    _output_batches: dict[int, ExpertBatch] | None = field(default=None, init=False, repr=False)

    def expert_done(self, result: LayerResult, names: tuple[str, ...]) -> None:
        """The method is done with these linears (one expert's): their integer weights leave `result` for the
        sink, their names go to `result.written`. Their dequantized weights stay in the layer (the pipeline runs
        it again to feed the next layer)."""
        if self.sink is None:
            return
        self.sink({n: result.weights.pop(n) for n in names})
        result.written.update(names)

    def expert_linears(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """(expert, its linears: gate, up, down or gate_up, down) of each expert whose linears are all quantized, in order. With a loader, each
        expert's weights are read before it is yielded and let go when the caller asks for the next one (or ends
        the loop), its share of the block's output first added to `output` when that is kept. A loop that ends early
        (a break, an error) still lets the expert on its turn go, without adding its share."""
        for e, names in self._quantized_experts():
            if self.loader is not None:
                self.loader(names)
            try:
                yield e, names
            except BaseException:  # GeneratorExit on an early end, or the caller's error: free it, then go on out
                if self.loader is not None:
                    self.block.expert_list[e].to("meta")
                raise
            if self.loader is not None:
                self._let_go(e)

    def visit_experts(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        """As expert_linears, for a pass that only reads the experts (a search before any is quantized): with a
        loader each is read for its turn and dropped after, nothing added to `output`."""
        for e, names in self._quantized_experts():
            if self.loader is not None:
                self.loader(names)
            try:
                yield e, names
            finally:
                if self.loader is not None:
                    self.block.expert_list[e].to("meta")

    def _quantized_experts(self) -> Iterator[tuple[int, tuple[str, ...]]]:
        spec = self.layer.spec.experts
        for e in range(self.block.shape.num_experts):
            names = spec.linears_of(e)
            if all(n in self.quantized for n in names):
                yield e, names

    def _let_go(self, e: int) -> None:
        """Expert e's share of the block's output added to `output` (with the weights the method left it), then its
        weights dropped (to the meta device)."""
        expert = self.block.expert_list[e]
        tokens = self.output_tokens or self.tokens
        batch = None
        if self.output is not None:
            batch = (self._output_batches if self.output_tokens is not None else self._batches()).get(e)
        if batch is not None:  # run by run, as the block computes it in the layer's runs (the same bits)
            for start, end in run_bounds(tokens.runs, self.output.shape[0]):
                lo, hi = torch.searchsorted(batch.rows, torch.tensor([start, end])).tolist()
                if lo == hi:
                    continue
                rows = batch.rows[lo:hi]
                with torch.no_grad(), self.layer.autocast():
                    y = expert(tokens.x[rows]) * batch.weights[lo:hi, None]
                self.output.index_add_(0, rows, y.to(self.output.dtype))
        expert.to("meta")

    def recapture(self) -> None:
        """`output_tokens` from the layer as it is now (its runs stop at the block): after a change to what feeds the
        block (AWQ folds a scale into the norm and the router), the block's output for the next layer is computed on
        what the changed layer feeds it, so it is the output of the layer that is written, to the bit."""
        self.output_tokens = route_tokens(self.layer, self.block, capture_block_input(self.layer, self.block_path))
        self._output_batches = self._routed(self.output_tokens)

    def _batches(self) -> dict[int, ExpertBatch]:
        """The calibration tokens routed to each expert that got any (made once)."""
        if self._by_expert is None:
            self._by_expert = self._routed(self.tokens)
        return self._by_expert

    def _routed(self, t: RoutedTokens) -> dict[int, ExpertBatch]:
        return {b.expert: b for b in expert_batches(t.weights, t.experts, self.block.shape.num_experts)}

    def experts(self) -> Iterator[ExpertWork]:
        """Each quantized expert with its calibration tokens, one at a time (each x made only on its turn)."""
        tokens = self.tokens
        batches = self._batches()
        prior = _strided(tokens.x, self.prior_tokens)
        cached: list[torch.Tensor] = []

        def input_prior() -> torch.Tensor:  # one [hidden, hidden] kept for the layer, made on first use
            if not cached:
                cached.append(gram(self.layer, prior))
            return cached[0]

        for e, names in self.expert_linears():
            batch = batches.get(e)
            x = tokens.x[:0] if batch is None else tokens.x[batch.rows]
            yield ExpertWork(e, names[:-1], names[-1], self.block.expert_list[e], x, prior, self.layer, input_prior)


def capture_block_input(ctx: LayerContext, block_path: str) -> torch.Tensor:
    """The MoE block's input [T, hidden] fp32 on every calibration token, the layer as it is now (its
    attention quantized): each run stops at the block."""
    block = get_submodule(ctx.layer, block_path)
    tokens = sum(x.shape[0] * x.shape[1] for x in ctx.inputs)
    out: torch.Tensor | None = None  # [T, hidden], filled run by run (no list of runs joined at the end: 2x its size)
    filled = 0

    def hook(_module, args):
        nonlocal out, filled
        x = args[0].reshape(-1, args[0].shape[-1])
        if out is None:
            out = torch.empty(tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out[filled:filled + x.shape[0]].copy_(x)
        filled += x.shape[0]
        raise _HaveBlockInput

    handle = block.register_forward_pre_hook(hook)
    try:
        ctx.run_for_hooks(_HaveBlockInput)
    finally:
        handle.remove()
    if out is None or filled != tokens:
        raise RuntimeError(f"the MoE block saw {filled} of the {tokens} calibration tokens")
    return out


def route_tokens(ctx: LayerContext, block: SparseMoeBlock, x: torch.Tensor) -> RoutedTokens:
    """The float router's top-k choices for x [T, hidden], as the layer computes them: run by run where x is the block's
    input on ctx.inputs (capture_block_input; the same arithmetic as the layer's own runs), else in chunks."""
    runs = run_sizes(ctx)
    if sum(runs) != x.shape[0]:
        runs = ()
    bounds = run_bounds(runs, x.shape[0]) if runs else [(s, min(s + CHUNK_TOKENS, x.shape[0]))
                                                        for s in range(0, x.shape[0], CHUNK_TOKENS)]
    weights, experts = [], []
    with torch.no_grad(), ctx.autocast():
        for start, end in bounds:
            w, e = block.route(x[start:end])
            weights.append(w.float())
            experts.append(e)
    return RoutedTokens(x, torch.cat(weights), torch.cat(experts), runs)


def replay_layer(ctx: LayerContext, block_path: str, block_output: torch.Tensor) -> list[torch.Tensor]:
    """The layer's outputs on ctx.inputs (as ctx.run_layer) with its MoE block's output taken from `block_output`
    [T, hidden] (the block's output on every calibration token, runs in order) instead of computed: its experts
    need not be in the layer."""
    block = get_submodule(ctx.layer, block_path)
    taken = 0

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        nonlocal taken
        n = hidden.numel() // hidden.shape[-1]
        if taken + n > block_output.shape[0]:
            raise RuntimeError(f"the MoE block's replay ran past its {block_output.shape[0]} tokens")
        out = block_output[taken:taken + n].view_as(hidden).to(hidden.dtype)
        taken += n
        return as_block_output(block.spec, out)

    block.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    try:
        outputs = ctx.run_layer()
    finally:
        del block.forward
    if taken != block_output.shape[0]:
        raise RuntimeError(f"the MoE block's replay used {taken} of its {block_output.shape[0]} tokens")
    return outputs


def quantize_experts(ctx: LayerContext, method, calibrated: bool, sink: ExpertSink | None = None,
                     loader: ExpertLoader | None = None, propagate: bool = False) -> LayerResult:
    """The layer's experts (ctx.experts) through `method.quantize_experts` (calibrated methods: with routed
    tokens); each expert's integer weights to `sink` as soon as they are final (without: in the result).
    `loader`: the experts are not in the layer, each is read on its turn and let go after (see the module
    docstring); then with `propagate` the result's outputs are the layer's on ctx.inputs, for the next layer."""
    spec = ctx.spec.experts
    block = get_submodule(ctx.layer, spec.block)
    moe = MoEContext(ctx, block, spec.block, ctx.experts, sink=sink, loader=loader)
    if calibrated:
        moe.tokens = route_tokens(ctx, block, capture_block_input(ctx, spec.block))
        if loader is not None and propagate:
            moe.output = torch.zeros_like(moe.tokens.x)
    result = method.quantize_experts(moe)
    if calibrated:  # tokens routed to each expert: the prior's share of its statistics is K / (n + K)
        counts = torch.bincount(moe.tokens.experts.reshape(-1), minlength=block.shape.num_experts)
        result.stats["expert_tokens"] = counts.tolist()
    if moe.output is not None:
        moe.tokens = moe.output_tokens = None  # the block's input, no longer needed: not beside the layer's outputs
        result.outputs, result.outputs_are_float = replay_layer(ctx, spec.block, moe.output), False
    return result
