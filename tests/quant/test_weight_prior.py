"""quantkit.quant.weight_prior: the data-free estimate of each linear's input mean square, against the mean squares
measured on a layer fed with hidden states whose normalized channels are uncorrelated and of unit mean square."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.arch import spec_for
from quantkit.quant.weight_prior import (activation_mean_square, layer_mean_squares, norm_mean_square,
                                         output_mean_square, over_query_heads)


def test_norm_mean_square_adds_the_offset():
    assert torch.equal(norm_mean_square(torch.tensor([0.5, -2.0]), 1.0), torch.tensor([2.25, 1.0]))


def test_output_mean_square_matches_sampled_outputs():
    g = torch.Generator().manual_seed(0)
    w, imp = torch.randn(5, 7, generator=g), torch.rand(7, generator=g) * 3
    x = torch.randn(400_000, 7, generator=g) * imp.sqrt()
    measured = (x @ w.T).square().mean(0)
    torch.testing.assert_close(output_mean_square(w, imp), measured, rtol=0.02, atol=0)


@pytest.mark.parametrize("act, exact", [(torch.nn.Identity(), lambda v: v), (torch.relu, lambda v: v / 2)])
def test_activation_mean_square_closed_forms(act, exact):
    var = torch.tensor([0.01, 1.0, 7.5])
    torch.testing.assert_close(activation_mean_square(act, var), exact(var), rtol=1e-5, atol=0)


def test_activation_mean_square_of_silu_matches_samples():
    var = torch.tensor([0.1, 1.0, 9.0])
    g = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    measured = torch.stack([torch.nn.functional.silu(g * v.sqrt()).square().mean() for v in var])
    torch.testing.assert_close(activation_mean_square(torch.nn.functional.silu, var), measured, rtol=0.01, atol=0)


def test_over_query_heads_repeats_each_kv_head_for_its_query_heads():
    imp_v = torch.arange(6.0)  # 2 KV heads of 3 channels
    assert over_query_heads(imp_v, 12, 2).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert over_query_heads(imp_v, 6, 2) is imp_v  # MHA


def _measured_mean_squares(layer, names, hidden, forward=None, **kw):
    """The mean square of each named linear's input [K] over one forward of `hidden` (through `forward`, else the
    layer called with `kw`)."""
    sums = {}

    def hook(name):
        def fn(_mod, args):
            sums[name] = args[0].reshape(-1, args[0].shape[-1]).square().mean(0)
        return fn

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    with torch.no_grad():
        forward(hidden) if forward is not None else layer(hidden, **kw)
    for h in handles:
        h.remove()
    return sums


def test_layer_mean_squares_match_a_llama_layer_fed_unit_channels():
    """A GQA Llama layer (4 query / 2 KV heads), its norms' weights spread over 0.2-2, fed 20,000 one-token
    sequences of Gaussian hidden states (the attention then returns v itself): each linear's estimate is the
    measured mean square of its input, channel by channel."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=32, architectures=["LlamaForCausalLM"])
    layer = LlamaDecoderLayer(config, 0).eval()
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.2)
    # o_proj's output joins the residual stream that the MLP's norm reads: zero, the stream's channels stay of equal
    # mean square, as the estimate assumes; gate and up read disjoint channels, so that they are independent
    layer.self_attn.o_proj.weight.data.zero_()
    layer.mlp.gate_proj.weight.data[:, 32:] = 0
    layer.mlp.up_proj.weight.data[:, :32] = 0
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = torch.rand(64) * 1.8 + 0.2
    hidden = torch.randn(20_000, 1, 64)
    position_ids = torch.zeros(20_000, 1, dtype=torch.long)
    rope = LlamaRotaryEmbedding(config)(hidden, position_ids)
    spec = spec_for(config)
    names = spec.linears
    measured = _measured_mean_squares(layer, names, hidden, position_embeddings=rope, attention_mask=None,
                                      position_ids=position_ids)
    estimated = layer_mean_squares(layer, spec, config, names)
    assert estimated.keys() == set(names)
    for name in names:
        rel = (estimated[name] / measured[name] - 1).abs()
        limit = 0.2 if name == "mlp.down_proj" else 0.06  # down_proj's inputs are heavy-tailed: a wider sampling error
        assert float(rel.max()) < limit, (name, float(rel.max()))
        # the channels spread: a flat estimate (their mean) would miss by far more
        flat = float((measured[name].mean() / measured[name] - 1).abs().max())
        assert flat > 3 * limit, (name, flat)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_mean_squares_match_an_expert_fed_unit_channels(family, tiny_family):
    """Expert 0 of a tiny MoE model (quantkit's loader: one linear per expert), its MLP norm's weights spread over
    0.2-2, gate and up reading disjoint channels: each of its linears' estimates is the measured mean square of its
    input on 20,000 normalized Gaussian hidden states."""
    from quantkit.model.loader import load_model
    from quantkit.quant.weight_prior import expert_mean_squares

    model, _ = load_model(tiny_family(family))
    layer, spec = model.model.layers[0], spec_for(model.config)
    norm = layer.get_submodule(spec.norms.mlp_in)
    hidden = norm.weight.shape[0]
    torch.manual_seed(0)
    norm.weight.data = torch.rand(hidden) * 1.8 + 0.2
    expert = layer.get_submodule(spec.experts.expert(0))
    gate, up = (getattr(expert, n) for n in (spec.experts.gate, spec.experts.up))
    for linear in (gate, up, getattr(expert, spec.experts.down)):
        torch.nn.init.normal_(linear.weight, std=0.2)
    gate.weight.data[:, hidden // 2:] = 0
    up.weight.data[:, :hidden // 2] = 0
    names = spec.experts.linears_of(0)
    measured = _measured_mean_squares(layer, names, torch.randn(20_000, hidden), forward=lambda x: expert(norm(x)))
    estimated = expert_mean_squares(layer, spec, model.config, names)
    assert estimated.keys() == set(names)
    for name in names:
        limit = 0.2 if name.endswith(spec.experts.down) else 0.06
        assert float((estimated[name] / measured[name] - 1).abs().max()) < limit, name
