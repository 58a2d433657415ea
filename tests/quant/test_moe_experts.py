"""The experts of an MoE layer (quantkit/quant/moe_experts.py, awq_experts.py): each expert's statistics from the
tokens transformers' router sends it, blended with the block's prior (all of it for an expert the router starves),
one expert's Hessians alive at a time, and AWQ's fold into the norm, the experts and the router leaving the float
layer's function (and routing) unchanged."""

from __future__ import annotations

import weakref

import pytest
import torch

from quantkit.config import QuantizeConfig
from quantkit.format.arch import get_submodule, spec_for
from quantkit.format.primitives import QuantScheme
from quantkit.quant import moe_experts
from quantkit.quant.methods import LayerContext, merge_results
from quantkit.quant.moe_experts import MoEContext, RoutedTokens, capture_block_input, gram, route_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def layer_context(path, tmp_path, method: str = "gptq", samples: int = 4, seqlen: int = 64) -> LayerContext:
    """Layer 0 of a tiny MoE model (loaded through quantkit's loader: one linear per expert) with the inputs and
    keyword arguments the pipeline captures for it."""
    from quantkit.model.loader import load_model
    from quantkit.quant.capture import capture_layer_inputs

    model, _ = load_model(path)
    ids = torch.randint(3, 512, (samples, seqlen), generator=torch.Generator().manual_seed(0))
    inputs, kwargs = capture_layer_inputs(model.model, model.model.layers, ids, torch.device("cpu"))
    spec = spec_for(model.config)
    experts = frozenset(spec.expert_linears(len(get_submodule(model.model.layers[0], spec.experts.block).expert_list)))
    return LayerContext(index=0, layer=model.model.layers[0], spec=spec, model_config=model.config,
                        inputs=[torch.cat(inputs)], layer_kwargs=kwargs[0], scheme=QuantScheme(4, 32, True),
                        config=QuantizeConfig(model="m", out=tmp_path / "o", method=method, group_size=32),
                        linears=spec.linears, skipped={}, experts=experts)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_each_expert_sees_the_tokens_transformers_router_sends_it(family, tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM

    ctx = layer_context(tiny_family(family), tmp_path)
    spec = ctx.spec.experts
    block = get_submodule(ctx.layer, spec.block)
    x = capture_block_input(ctx, spec.block)  # [T, hidden]
    moe = MoEContext(ctx, block, spec.block, ctx.experts, route_tokens(ctx, block, x))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_family(family)), dtype=torch.float32).eval()
    with torch.no_grad():
        _, _, chosen = hf.model.layers[0].mlp.gate(x)  # transformers' router on the same input: [T, k]
    seen = 0
    for ex in moe.experts():
        rows = (chosen == ex.index).any(dim=-1).nonzero().squeeze(-1)
        assert torch.equal(ex.x, x[rows]) and ex.routed == rows.numel()
        seen += ex.routed
    assert seen == x.shape[0] * block.shape.top_k


def test_statistics_blend_the_routed_tokens_with_the_blocks_prior(tiny_family, tmp_path):
    """H = (n H_routed + K H_prior) / (n + K) for an expert with n tokens (K: the input width); the prior alone for
    one the router never picks; the prior is an evenly strided sample of every token of the block."""
    ctx = layer_context(tiny_family("qwen3_moe"), tmp_path)
    spec = ctx.spec.experts
    block = get_submodule(ctx.layer, spec.block)
    x = capture_block_input(ctx, spec.block)  # [256, 128]
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, 7, (x.shape[0],), generator=g)
    second = (first + torch.randint(1, 7, (x.shape[0],), generator=g)) % 7
    chosen = torch.stack([first, second], dim=1) + 1  # two distinct experts a token, never expert 0
    tokens = RoutedTokens(x, torch.full((x.shape[0], 2), 0.5), chosen)
    works = {w.index: w for w in MoEContext(ctx, block, spec.block, ctx.experts, tokens, prior_tokens=64).experts()}
    prior = x[torch.linspace(0, x.shape[0] - 1, 64).long()]
    assert torch.equal(works[0].prior, prior) and works[0].routed == 0
    torch.testing.assert_close(works[0].hessian(), gram(ctx, prior))
    w = works[3]
    n, k = w.routed, x.shape[1]
    assert n == int((chosen == 3).any(dim=-1).sum())
    want = (n * gram(ctx, x[(chosen == 3).any(dim=-1)]) + k * gram(ctx, prior)) / (n + k)
    torch.testing.assert_close(w.hessian(), want)
    down_in = w.module.hidden  # down's statistics: the same blend over its own input width
    want = (n * gram(ctx, w.x, down_in) + 128 * gram(ctx, prior, down_in)) / (n + 128)
    torch.testing.assert_close(w.hessian(down_in), want)
    sample, own = w.sample(40), round(40 * n / (n + k))  # routed rows then prior rows, in the blend's shares

    def rows_of(rows, pool):
        return all(any(torch.equal(r, t) for t in pool) for r in rows)
    assert sample.shape[0] == 40 and rows_of(sample[:own], w.x) and rows_of(sample[own:], prior)


def test_gptq_keeps_one_experts_hessian_alive_at_a_time(tiny_family, tmp_path, monkeypatch):
    """Peak memory: the Hessian of the expert being quantized (and the layer's prior), never every expert's."""
    from quantkit.quant.gptq_layer import GPTQMethod

    ctx = layer_context(tiny_family("qwen3_moe"), tmp_path)
    alive = weakref.WeakSet()
    made = moe_experts.empty_hessian

    def tracked(k, device="cpu"):
        h = made(k, device)
        alive.add(h)
        return h

    peaks = []
    original = GPTQMethod._quantize_stack

    def stack(self, ctx, names, result, h):
        peaks.append(len(alive))
        return original(self, ctx, names, result, h)

    monkeypatch.setattr(moe_experts, "empty_hessian", tracked)
    monkeypatch.setattr(GPTQMethod, "_quantize_stack", stack)
    result = moe_experts.quantize_experts(ctx, GPTQMethod(ctx.config), calibrated=True)
    assert set(result.weights) == set(ctx.experts)
    assert len(peaks) == 2 * 8 and max(peaks) == 2  # the expert's own, and the layer's prior for gate/up
    assert sum(result.stats["expert_tokens"]) == 4 * 64 * 2


def test_awq_fold_over_the_experts_keeps_the_layer_and_its_routing(tiny_family, tmp_path):
    """The MLP norm's scale folded into every expert's gate/up and into the router's columns: the float layer's
    outputs and the router's choices are unchanged (AWQ's search judges candidates on this identity)."""
    from quantkit.quant.awq_apply import fold_scale

    ctx = layer_context(tiny_family("mixtral"), tmp_path, method="awq")
    spec = ctx.spec
    block = get_submodule(ctx.layer, spec.experts.block)
    x = capture_block_input(ctx, spec.experts.block)
    before_routes = route_tokens(ctx, block, x).experts
    before = ctx.run_layer()
    joint = spec.expert_awq_groups(4)[0]
    s = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5
    fold_scale(ctx.layer, joint, s, ctx.model_config, spec.norms.offset, also_scaled=(spec.experts.router_path,))
    after_x = capture_block_input(ctx, spec.experts.block)
    torch.testing.assert_close(after_x, x / s)
    assert torch.equal(route_tokens(ctx, block, after_x).experts, before_routes)
    torch.testing.assert_close(ctx.run_layer()[0], before[0], rtol=1e-4, atol=1e-5)


def test_gemma_norm_fold_respects_the_one_plus_weight(tiny_family, tmp_path):
    """Gemma's norms scale by (1 + w): a fold divides (1 + w), not w."""
    from transformers import AutoModelForCausalLM

    from quantkit.quant.awq_apply import fold_scale

    model = AutoModelForCausalLM.from_pretrained(str(tiny_family("gemma3")), dtype=torch.float32).eval()
    layer, spec = model.model.layers[0], spec_for(model.config)
    x = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(0))
    norm = get_submodule(layer, spec.norms.mlp_in)
    mlp_in = layer.mlp(norm(x))
    s = torch.rand(128, generator=torch.Generator().manual_seed(1)) + 0.5
    fold_scale(layer, spec.groups[2], s, model.config, spec.norms.offset)
    torch.testing.assert_close(layer.mlp(norm(x)), mlp_in, rtol=1e-4, atol=1e-5)


def test_a_saved_awq_plan_replays_an_moe_checkpoint_bit_for_bit(quantized_family, tiny_family, tmp_path):
    """--load-plan covers the experts: the joint norm scale, each expert's down scale and every clip."""
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig
    from quantkit.format.awq_plan import load_plan
    from quantkit.quant.pipeline import quantize_model

    first = quantized_family("qwen3_moe", "awq", "awq")
    plan = load_plan(first / "awq_plan.safetensors")
    assert "layers.1.mlp.experts.gate_up.scale" in plan and "layers.1.mlp.experts.7.down.scale" in plan
    assert "layers.0.mlp.experts.3.up_proj.clip" in plan
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(64, seed=9)))  # other text: only the plan can make the same weights
    out = tmp_path / "again"
    out.mkdir()
    cfg = QuantizeConfig(model=str(tiny_family("qwen3_moe")), out=out, method="awq", format="awq", bits=4,
                         group_size=32, calib=CalibConfig(source=str(calib), nsamples=8, seqlen=64), device="cpu",
                         load_plan=first / "awq_plan.safetensors")
    quantize_model(cfg, out_dir=out, show_progress=False)
    assert (out / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()


def test_each_layer_gets_its_own_rope_and_mask_in_the_capture(tiny_family):
    """Gemma 3's sliding layer and full layer are called with different RoPE (bases 1e4, 1e6) and masks: the
    pipeline captures each layer's arguments, not layer 0's for all."""
    from quantkit.model.loader import load_model
    from quantkit.quant.capture import capture_layer_inputs

    model, _ = load_model(tiny_family("gemma3"))
    ids = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    inputs, kwargs = capture_layer_inputs(model.model, model.model.layers, ids, torch.device("cpu"))
    assert len(inputs) == 2 and len(kwargs) == 2
    (cos0, _), (cos1, _) = kwargs[0]["position_embeddings"], kwargs[1]["position_embeddings"]
    assert not torch.equal(cos0, cos1)
    m0, m1 = kwargs[0]["attention_mask"], kwargs[1]["attention_mask"]
    assert m0 is not None and (m1 is None or not torch.equal(m0, m1))  # 64 tokens run past the 24-token window
    seen = []  # transformers' own forward of sample 0: what its layers 0 and 1 output
    hooks = [layer.register_forward_hook(lambda _m, _a, out: seen.append(out)) for layer in model.model.layers]
    with torch.no_grad():
        model(ids[:1])
        for h in hooks:
            h.remove()
        hidden = model.model.layers[0](inputs[0], **kwargs[0])
        torch.testing.assert_close(hidden, seen[0])
        torch.testing.assert_close(model.model.layers[1](hidden, **kwargs[1]), seen[1])


def streamed_loader(ctx: LayerContext):
    """The layer's experts taken out (to the meta device) and a loader that puts one expert's weights back as the
    pipeline's reads them; with the list of its loads and, at each, the expert parameters in the layer."""
    block = get_submodule(ctx.layer, ctx.spec.experts.block)
    weights = {n: get_submodule(ctx.layer, n).weight.detach().clone() for n in ctx.experts}
    block.expert_list.to("meta")
    loads, held = [], []

    def loader(names):
        loads.append(names)
        for n in names:
            get_submodule(ctx.layer, n).weight = torch.nn.Parameter(weights[n].clone(), requires_grad=False)
        held.append(sum(not p.is_meta for p in block.expert_list.parameters()))

    return loader, loads, held


def test_a_loop_over_streamed_experts_that_ends_early_lets_the_loaded_expert_go(tiny_family, tmp_path):
    ctx = layer_context(tiny_family("qwen3_moe"), tmp_path)
    spec = ctx.spec.experts
    block = get_submodule(ctx.layer, spec.block)
    loader, loads, held = streamed_loader(ctx)
    moe = MoEContext(ctx, block, spec.block, ctx.experts, loader=loader)
    for e, _ in moe.expert_linears():
        if e == 2:
            break
    assert len(loads) == 3 and held == [3, 3, 3]
    assert all(p.is_meta for p in block.expert_list.parameters())
    with pytest.raises(RuntimeError, match="stop"):
        for _ in moe.expert_linears():
            raise RuntimeError("stop")
    assert all(p.is_meta for p in block.expert_list.parameters())


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_streamed_experts_are_loaded_one_at_a_time_and_replayed_into_the_layers_outputs(tiny_family, tmp_path,
                                                                                      method):
    """With a loader, the layer holds no expert's weights but the one on its turn, and the outputs for the next
    layer (the block's output summed as experts are let go, replayed into the layer's re-run) equal those of the
    layer re-run with every expert's dequantized weights in it, to the bit (run by run, as the layer computes)."""
    from quantkit.quant.pipeline import make_method

    ctx = layer_context(tiny_family("qwen3_moe"), tmp_path, method=method)
    ctx.inputs = list(ctx.inputs[0].split([3, 1]))  # two runs of the layer, of 192 and 64 tokens
    block = get_submodule(ctx.layer, ctx.spec.experts.block)
    loader, loads, held = streamed_loader(ctx)

    result = moe_experts.quantize_experts(ctx, make_method(ctx.config), calibrated=True, loader=loader,
                                          propagate=True)
    assert loads == [ctx.spec.experts.linears_of(e) for e in range(8)] and held == [3] * 8
    assert all(p.is_meta for p in block.expert_list.parameters())  # each let go after its turn
    for n in ctx.experts:  # the layer as the method left it, every expert in: re-run through its experts
        get_submodule(ctx.layer, n).weight = torch.nn.Parameter(result.weights[n].dequantize(), requires_grad=False)
    expected = ctx.run_layer()
    assert len(result.outputs) == len(expected) and not result.outputs_are_float
    assert all(torch.equal(got, want) for got, want in zip(result.outputs, expected))


def test_awq_streamed_reads_one_expert_at_a_time_and_chooses_what_the_whole_layer_does(tiny_family, tmp_path,
                                                                                      monkeypatch):
    """AWQ with the experts streamed (each read on its turn; the joint scale's candidates judged one per pass here, so
    every expert is read once per candidate): only one expert is ever in the layer, the dense stage stops its runs
    at the MoE block, and the plan, the integer weights and the outputs for the next layer equal, to the bit, those
    of AWQ with every expert in the layer."""
    from quantkit.quant import awq_experts
    from quantkit.quant.awq_search import scale_candidates
    from quantkit.quant.pipeline import make_method

    monkeypatch.setattr(awq_experts, "JOINT_BUFFER_BYTES", 1)
    path = tiny_family("qwen3_moe")
    whole = layer_context(path, tmp_path, method="awq")
    whole.inputs = list(whole.inputs[0].split([3, 1]))
    method = make_method(whole.config)
    want = merge_results(method.quantize_layer(whole), moe_experts.quantize_experts(whole, method, calibrated=True))

    ctx = layer_context(path, tmp_path, method="awq")
    ctx.inputs, ctx.experts_streamed = list(ctx.inputs[0].split([3, 1])), True
    loader, loads, held = streamed_loader(ctx)

    method = make_method(ctx.config)
    got = merge_results(method.quantize_layer(ctx),
                        moe_experts.quantize_experts(ctx, method, calibrated=True, loader=loader, propagate=True))
    cfg = ctx.config
    candidates = len(scale_candidates(torch.ones(2), torch.ones(2), cfg.awq_grid, cfg.awq_duo_scaling))
    reads = candidates + cfg.awq_weight_statistic + 1  # one pass a candidate, one for the statistic, one to quantize
    assert [loads.count(ctx.spec.experts.linears_of(e)) for e in range(8)] == [reads] * 8 and set(held) == {3}
    assert got.stats["loss_at"] == "mlp input" and "loss_at" not in want.stats
    assert got.plan.keys() == want.plan.keys() and all(torch.equal(got.plan[k], want.plan[k]) for k in want.plan)
    assert got.weights.keys() == want.weights.keys()
    for n, qw in want.weights.items():
        assert all(torch.equal(getattr(got.weights[n], a), getattr(qw, a)) for a in ("qweight", "scales", "zeros")), n
    expected = whole.run_layer()  # the whole layer as AWQ left it, every expert's dequantized weights in it
    assert all(torch.equal(a, b) for a, b in zip(got.outputs, expected, strict=True))


def test_a_replay_with_the_wrong_number_of_tokens_is_refused_and_the_block_left_as_it_was(tiny_family, tmp_path):
    ctx = layer_context(tiny_family("qwen3_moe"), tmp_path)
    path = ctx.spec.experts.block
    block = get_submodule(ctx.layer, path)
    tokens = sum(x.shape[0] * x.shape[1] for x in ctx.inputs)
    hidden = ctx.inputs[0].shape[-1]
    with pytest.raises(RuntimeError, match=f"used {tokens} of its {tokens + 1} tokens"):
        moe_experts.replay_layer(ctx, path, torch.zeros(tokens + 1, hidden))
    with pytest.raises(RuntimeError, match=f"ran past its {tokens - 1} tokens"):
        moe_experts.replay_layer(ctx, path, torch.zeros(tokens - 1, hidden))
    assert "forward" not in vars(block)  # the block computes its own output again
    with torch.no_grad():  # the block's own output replayed: the layer's outputs, to the bit
        replayed = moe_experts.replay_layer(ctx, path, block(capture_block_input(ctx, path)))
    assert all(torch.equal(a, b) for a, b in zip(replayed, ctx.run_layer(), strict=True))
