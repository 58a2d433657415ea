"""AWQMethod on real decoder layers: folding is exact in float, AWQ beats RTN, plans replay bit for bit."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from quantkit.config import QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.format.arch import get_submodule, head_counts, spec_for, tie_over_query_heads
from quantkit.quant.awq import AWQMethod
from quantkit.quant.awq_apply import fold_reason, fold_scale
from quantkit.format.awq_plan import layer_prefix, save_plan
from quantkit.quant.methods import LayerContext
from quantkit.format.packing import packable
from quantkit.format.primitives import QuantScheme


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_float(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def layer_inputs(model, nsamples: int = 4, seqlen: int = 64, seed: int = 0, outlier_channels: int = 0):
    """Hidden states entering layer 0 for random token ids, and the layer kwargs (RoPE; causal by default).

    `outlier_channels` multiplies a few hidden channels by 20, the activation outliers real LLMs
    show and a random model lacks (AWQ exists because of them).
    """
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = [torch.randint(3, vocab, (1, seqlen), generator=g) for _ in range(nsamples)]
    with torch.no_grad():
        xs = [model.model.embed_tokens(i) for i in ids]
        if outlier_channels:
            boost = torch.ones(xs[0].shape[-1])
            boost[torch.randperm(boost.numel(), generator=g)[:outlier_channels]] = 20.0
            xs = [x * boost for x in xs]
        pos = torch.arange(seqlen).unsqueeze(0)
        cos_sin = model.model.rotary_emb(xs[0], pos)
    return xs, {"position_embeddings": cos_sin, "attention_mask": None, "position_ids": pos}


def make_ctx(model, layer, xs, kwargs, scheme: QuantScheme, config: QuantizeConfig, index: int = 0) -> LayerContext:
    spec = spec_for(model.config)
    linears, skipped = [], {}
    for name in spec.linears:
        w = get_submodule(layer, name).weight
        reason = packable(w.shape[0], w.shape[1], scheme, "awq")
        if reason is None:
            linears.append(name)
        else:
            skipped[name] = reason
    return LayerContext(index=index, layer=layer, spec=spec, model_config=model.config, inputs=xs,
                        layer_kwargs=kwargs, scheme=scheme, config=config, linears=tuple(linears), skipped=skipped)


def awq_config(tmp_path: Path, group_size: int, **kw) -> QuantizeConfig:
    return QuantizeConfig(model="unused", out=tmp_path / "out", method="awq", group_size=group_size, **kw)


def block_errors(model, xs, kwargs, scheme, config, layer_index: int = 0):
    """(RTN error, AWQ error, result, quantized layer): block output MSE against the float layer."""
    layer = copy.deepcopy(model.model.layers[layer_index])
    ctx = make_ctx(model, layer, xs, kwargs, scheme, config, layer_index)
    ref = ctx.run_layer()
    result = AWQMethod(config).quantize_layer(ctx)
    awq_out = ctx.run_layer()
    err = sum(float((o - r).pow(2).sum()) for o, r in zip(awq_out, ref)) / sum(r.numel() for r in ref)
    return result.stats["loss_rtn"], err, result, layer


def test_awq_block_error_below_rtn_on_tiny_llama(tiny_llama, tmp_path):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, outlier_channels=4)
    config = awq_config(tmp_path, 32)
    rtn, awq, result, _ = block_errors(model, xs, kwargs, config.scheme, config)
    assert awq == pytest.approx(result.stats["loss_awq"], rel=1e-6)
    assert awq < 0.8 * rtn, (awq, rtn)
    assert set(result.weights) == set(spec_for(model.config).linears)
    # GQA (4 heads / 2 kv heads): v -> o is scaled too, with a scale tied over the query heads of a kv head
    assert result.stats["skipped_groups"] == {}
    assert {"qkv", "o", "gate_up", "down"} == set(result.stats["groups"])
    o_scale = result.plan["o.scale"].reshape(2, 2, -1)  # [kv, heads per kv, head_dim]
    assert torch.equal(o_scale[:, 0], o_scale[:, 1])
    # every linear is clipped (the spec's awq_no_clip is empty for Llama)
    assert {k for k in result.plan if k.endswith(".clip")} == {f"{n}.clip" for n in result.weights}
    for g in result.stats["groups"].values():
        assert 0.0 <= g["ratio"] < 1.0 and g["loss_scaled"] <= g["loss_unscaled"]
    qkv = result.stats["groups"]["qkv"]  # the outlier channels feed q/k/v: a real scale must win
    assert qkv["ratio"] > 0 and qkv["loss_scaled"] < 0.7 * qkv["loss_unscaled"]


def test_the_specs_awq_no_clip_linears_are_quantized_unclipped(tiny_llama, tmp_path):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32, outlier_channels=4)
    config = awq_config(tmp_path, 32)
    layer = copy.deepcopy(model.model.layers[0])
    ctx = make_ctx(model, layer, xs, kwargs, config.scheme, config)
    qk = ("self_attn.q_proj", "self_attn.k_proj")
    ctx = dataclasses.replace(ctx, spec=dataclasses.replace(ctx.spec, awq_no_clip=qk))
    result = AWQMethod(config).quantize_layer(ctx)
    assert {k for k in result.plan if k.endswith(".clip")} == {f"{n}.clip" for n in result.weights if n not in qk}


def test_awq_leaves_dequantized_weights_in_the_layer(tiny_llama, tmp_path):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32)
    config = awq_config(tmp_path, 64)
    _, _, result, layer = block_errors(model, xs, kwargs, config.scheme, config)
    for name, qw in result.weights.items():
        assert torch.equal(get_submodule(layer, name).weight.data, qw.dequantize())
        assert qw.scheme.sym is False and int(qw.qweight.max()) <= 15 and int(qw.qweight.min()) >= 0


def test_next_inputs_are_the_quantized_layers_outputs_unless_float_is_asked(tiny_llama, tmp_path):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32)
    outs = {}
    for which in ("quantized", "float"):
        config = awq_config(tmp_path, 32, awq_next_inputs=which)
        layer = copy.deepcopy(model.model.layers[0])
        ctx = make_ctx(model, layer, xs, kwargs, config.scheme, config)
        ref = copy.deepcopy(ctx).run_layer()
        result = AWQMethod(config).quantize_layer(ctx)
        outs[which] = (result.outputs, ref, ctx.run_layer())
    quantized, ref, run = outs["quantized"]
    assert all(torch.equal(o, r) for o, r in zip(quantized, run))
    assert not any(torch.equal(o, r) for o, r in zip(quantized, ref))
    floats, ref, _ = outs["float"]
    assert all(torch.allclose(o, r, atol=1e-5) for o, r in zip(floats, ref))
    with pytest.raises(QuantkitError, match="unknown --awq-next-inputs 'fp32'"):
        awq_config(tmp_path, 32, awq_next_inputs="fp32")


def test_awq_block_error_below_rtn_on_real_stories_layer(stories_dir, tmp_path):
    model = load_float(stories_dir)
    tok_ids_model = model  # real trained weights: activations have their own outliers
    xs, kwargs = layer_inputs(tok_ids_model, nsamples=4, seqlen=128)
    with torch.no_grad():  # feed layer 2 with what layers 0-1 really produce
        for i in range(2):
            xs = [model.model.layers[i](x, **kwargs) for x in xs]
    config = awq_config(tmp_path, 64)
    rtn, awq, result, _ = block_errors(model, xs, kwargs, config.scheme, config, layer_index=2)
    assert awq < rtn, (awq, rtn)
    # hidden 64 / intermediate 172: only attention packs at group size 64; GQA 8/4 ties the v -> o scale
    assert set(result.weights) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert set(result.stats["groups"]) == {"qkv", "o"}
    assert set(result.stats["skipped_groups"]) == {"gate_up", "down"}
    per_linear = {f"{n}.{part}" for n in result.weights for part in ("clip", "gain")}
    assert set(result.plan) == {"qkv.scale", "o.scale"} | per_linear


@pytest.mark.parametrize("family,kv_heads", [("llama", 4), ("qwen2", 2), ("qwen3", 2)])
def test_folding_scales_leaves_the_float_layer_unchanged(family, kv_heads, tmp_path):
    from tests_support.tiny_models import make_tiny_model

    model = load_float(make_tiny_model(tmp_path / family, family=family, kv_heads=kv_heads, layers=1))
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32, outlier_channels=4)
    layer = model.model.layers[0]
    ctx = make_ctx(model, layer, xs, kwargs, QuantScheme(4, 32, False), awq_config(tmp_path, 32))
    ref = ctx.run_layer()
    folded = []
    g = torch.Generator().manual_seed(1)
    for group in ctx.spec.groups:
        if fold_reason(layer, group, model.config) is None:
            k = get_submodule(layer, group.linears[0]).weight.shape[1]
            s = torch.rand(k, generator=g) * 4 + 0.25
            if group.feeder_repeats_kv:  # GQA: a v -> o scale must be tied over the query heads of a kv head
                s = tie_over_query_heads(s, *head_counts(model.config))
            fold_scale(layer, group, s, model.config)
            folded.append(group.name)
    expected = {"qkv", "o", "gate_up", "down"}
    assert set(folded) == expected
    for out, r in zip(ctx.run_layer(), ref):
        torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-5)


def test_v_to_o_scaled_with_full_heads(tmp_path):
    from tests_support.tiny_models import make_tiny_model

    model = load_float(make_tiny_model(tmp_path / "mha", kv_heads=4, layers=1))
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32, outlier_channels=4)
    config = awq_config(tmp_path, 32)
    rtn, awq, result, _ = block_errors(model, xs, kwargs, config.scheme, config)
    assert "o" in result.stats["groups"] and "o.scale" in result.plan
    assert awq < rtn


@pytest.mark.parametrize("duo", ["true", "both"])
def test_duo_scaling_runs_and_beats_rtn(tiny_llama, tmp_path, duo):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=64, outlier_channels=4)
    config = awq_config(tmp_path, 32, awq_duo_scaling=duo)
    rtn, awq, result, _ = block_errors(model, xs, kwargs, config.scheme, config)
    assert awq < rtn
    groups = result.stats["groups"].values()
    assert all("loss_unscaled" in g and isinstance(g["duo"], bool) for g in groups)
    assert all(g["loss_scaled"] <= g["loss_unscaled"] for g in groups)


def _run_layers(model, xs, kwargs, config, layers=(0, 1), **spec_fields):
    """AWQ over the given layers of a copy of the model, feeding quantized outputs forward (`spec_fields`:
    ArchSpec fields replaced for the run)."""
    model = copy.deepcopy(model)
    method = AWQMethod(config)
    results = []
    for i in layers:
        ctx = make_ctx(model, model.model.layers[i], xs, kwargs, config.scheme, config, i)
        ctx = dataclasses.replace(ctx, spec=dataclasses.replace(ctx.spec, **spec_fields))
        results.append(method.quantize_layer(ctx))
        xs = ctx.run_layer()
    return model, results


def _save(results, path):
    save_plan({layer_prefix(i) + k: v for i, r in enumerate(results) for k, v in r.plan.items()}, path)


def test_saved_plan_reproduces_weights_bit_for_bit(tiny_qwen2, tmp_path):
    model = load_float(tiny_qwen2)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=48, outlier_channels=4)
    searched_model, searched = _run_layers(model, xs, kwargs, awq_config(tmp_path, 32))
    plan_path = tmp_path / "awq_plan.safetensors"
    _save(searched, plan_path)
    loaded_model, loaded = _run_layers(model, xs, kwargs, awq_config(tmp_path, 32, load_plan=plan_path))
    for a, b in zip(searched, loaded):
        assert a.plan.keys() == b.plan.keys()
        assert all(torch.equal(a.plan[k], b.plan[k]) for k in a.plan)
        for name, qa in a.weights.items():
            qb = b.weights[name]
            assert torch.equal(qa.qweight, qb.qweight) and torch.equal(qa.scales, qb.scales)
            assert torch.equal(qa.zeros, qb.zeros)
    for (na, ta), (nb, tb) in zip(searched_model.state_dict().items(), loaded_model.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na  # norms and biases folded identically too


def test_a_plan_saved_with_q_k_unclipped_still_applies_bit_for_bit(tiny_llama, tmp_path):
    """Plans saved before AWQ clipped q/k have no clip for them: those linears are quantized unclipped."""
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=2, seqlen=32, outlier_channels=4)
    qk = ("self_attn.q_proj", "self_attn.k_proj")
    _, old = _run_layers(model, xs, kwargs, awq_config(tmp_path, 32), awq_no_clip=qk)
    assert not any(k.endswith(("q_proj.clip", "k_proj.clip")) for r in old for k in r.plan)
    plan_path = tmp_path / "old_plan.safetensors"
    _save(old, plan_path)
    _, loaded = _run_layers(model, xs, kwargs, awq_config(tmp_path, 32, load_plan=plan_path))
    for a, b in zip(old, loaded):
        assert a.plan.keys() == b.plan.keys()
        for name, qa in a.weights.items():
            assert torch.equal(qa.qweight, b.weights[name].qweight) and torch.equal(qa.scales, b.weights[name].scales)


def test_plan_that_does_not_match_is_a_clear_error(tiny_llama, tmp_path):
    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=1, seqlen=32)
    _, searched = _run_layers(model, xs, kwargs, awq_config(tmp_path, 32))
    good = {layer_prefix(i) + k: v for i, r in enumerate(searched) for k, v in r.plan.items()}

    def attempt(plan, group_size=32):
        path = tmp_path / "plan.safetensors"
        save_plan(plan, path)
        _run_layers(model, xs, kwargs, awq_config(tmp_path, group_size, load_plan=path))

    with pytest.raises(QuantkitError, match="does not match"):
        attempt({k: v for k, v in good.items() if k != "layers.1.gate_up.scale"})
    with pytest.raises(QuantkitError, match="shape"):
        attempt({**good, "layers.0.qkv.scale": torch.ones(7)})
    with pytest.raises(QuantkitError, match="holds 1 layers"):
        attempt({k: v for k, v in good.items() if k.startswith("layers.0.")})
    with pytest.raises(QuantkitError, match="shape"):
        attempt(good, group_size=64)  # clips have one column per group
    with pytest.raises(QuantkitError, match="no such file"):
        _run_layers(model, xs, kwargs, awq_config(tmp_path, 32, load_plan=tmp_path / "missing.safetensors"))


def test_merge_calls_batches_samples_and_keeps_outputs(tiny_llama):
    from quantkit.quant.awq import capture, merge_calls

    model = load_float(tiny_llama)
    xs, kwargs = layer_inputs(model, nsamples=5, seqlen=16)
    layer = model.model.layers[0]
    ctx = make_ctx(model, layer, xs, kwargs, QuantScheme(4, 32, False), None)
    cap = capture(ctx, list(ctx.spec.groups), inspect=True)
    calls = cap.calls["self_attn"]
    merged = merge_calls(calls, max_tokens=32)  # two samples of 16 tokens per call
    assert [c[1]["hidden_states"].shape[0] for c in merged] == [2, 2, 1]
    assert merged[0][1]["position_embeddings"] is calls[0][1]["position_embeddings"]  # shared, not stacked
    with torch.no_grad():
        one = torch.cat([layer.self_attn(*a, **kw)[0] for a, kw in calls])
        many = torch.cat([layer.self_attn(*a, **kw)[0] for a, kw in merged])
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)
    other = (calls[2][0], {**calls[2][1], "position_embeddings": tuple(t.clone() for t in kwargs["position_embeddings"])})
    split = merge_calls([calls[0], calls[1], other, calls[3]], max_tokens=1000)
    assert [c[1]["hidden_states"].shape[0] for c in split] == [2, 1, 1]  # a different non-tensor argument splits
