"""Architecture specs as data (quantkit/format/arch.py): every family's spec against transformers' own module tree
for that family (a tiny model built from its config class on the meta device), so a spec cannot name a linear that
is not there, miss one that is, or give it the wrong shape."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.arch import SPECS, SUPPORTED_ARCHITECTURES, config_dims, get_submodule, moe_shape, spec_for
from tests_support.tiny_models import FAMILIES


def tiny_config(family: str):
    import transformers

    cfg_name, _, extra = FAMILIES[family]
    return getattr(transformers, cfg_name)(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, **extra)


def test_every_spec_has_a_tiny_model_and_the_families_are_distinct():
    assert {s.family for s in SPECS} == set(FAMILIES)
    assert len(SUPPORTED_ARCHITECTURES) == len(set(SUPPORTED_ARCHITECTURES))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_spec_names_every_linear_of_transformers_layer_with_its_shape(family):
    from quantkit.model.loader import build_skeleton

    config = tiny_config(family)
    config.architectures = [FAMILIES[family][1]]
    spec = spec_for(config)
    assert spec.family == family
    model = build_skeleton(config, torch.float32)
    layer = get_submodule(model, spec.layers)[0]
    dims = config_dims(config)
    named = set(spec.layer_linears(config))
    for name in named:
        n, k = (dims[d] for d in spec.dims_of(name))
        assert tuple(get_submodule(layer, name).weight.shape) == (n, k), name
    present = {n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert present == named | set(spec.float_linears())
    for group in spec.awq_groups(config):
        assert get_submodule(layer, group.feeder) is not None and get_submodule(layer, group.inspect) is not None
        if not group.feeder_is_norm and not group.feeder_repeats_kv:  # a down_proj: act(gate) * up, gate named
            assert group.gate in named, group.name
    norms = [spec.norms.attn_in, spec.norms.mlp_in, spec.norms.attn_out, spec.norms.mlp_out]
    assert all(hasattr(layer, n) for n in norms if n is not None)


def test_gpt_oss_stacked_experts_are_one_linear_per_expert_in_the_skeleton():
    """gpt-oss keeps its experts as 3-D parameters (no linear per expert); the spec's per-expert linears are slices of
    them: gate_up [2I, H] (rows interleaved) and down [H, I], each with a bias, and the router has one too."""
    from transformers import AutoModelForCausalLM

    from quantkit.model.loader import build_skeleton

    config = tiny_config("gpt_oss")
    config.architectures = ["GptOssForCausalLM"]
    spec, moe = spec_for(config), moe_shape(spec_for(config), config)
    with torch.device("meta"):
        hf_layer = get_submodule(AutoModelForCausalLM.from_config(config), spec.layers)[0]
    x = spec.experts
    stacked = get_submodule(hf_layer, f"{x.block}.{x.experts}")
    e, h, i = moe.num_experts, config.hidden_size, moe.intermediate
    assert tuple(getattr(stacked, x.gate_up).shape) == (e, h, 2 * i) and tuple(getattr(stacked, x.down).shape) == (e, i, h)
    assert tuple(hf_layer.self_attn.sinks.shape) == (config.num_attention_heads,)
    layer = get_submodule(build_skeleton(config, torch.float32), spec.layers)[0]
    assert spec.experts.linears_of(3) == ("mlp.experts.3.gate_up_proj", "mlp.experts.3.down_proj")
    gate_up, down = (get_submodule(layer, n) for n in spec.experts.linears_of(3))
    assert gate_up.weight.shape == (2 * i, h) and gate_up.bias.shape == (2 * i,) and down.bias.shape == (h,)
    assert get_submodule(layer, x.router_path).bias.shape == (e,)
    assert [g.name for g in spec.awq_groups(config)][-1] == "mlp.experts.gate_up"  # no down group: not through up


def test_moe_shapes_come_from_the_config():
    mixtral, qwen = tiny_config("mixtral"), tiny_config("qwen3_moe")
    mixtral.architectures, qwen.architectures = ["MixtralForCausalLM"], ["Qwen3MoeForCausalLM"]
    m = moe_shape(spec_for(mixtral), mixtral)
    q = moe_shape(spec_for(qwen), qwen)
    assert (m.num_experts, m.top_k, m.intermediate, m.renormalize) == (4, 2, 256, True)  # Mixtral always renormalizes
    assert (q.num_experts, q.top_k, q.intermediate, q.renormalize) == (8, 2, 128, True)  # norm_topk_prob
    assert moe_shape(spec_for({"architectures": ["LlamaForCausalLM"]}), {}) is None


def test_expert_names_parse_back():
    spec = spec_for({"architectures": ["MixtralForCausalLM"]})
    assert spec.experts.linears_of(3) == ("block_sparse_moe.experts.3.w1", "block_sparse_moe.experts.3.w3",
                                          "block_sparse_moe.experts.3.w2")
    assert spec.experts.parse("block_sparse_moe.experts.12.w2") == (12, "down")
    assert spec.experts.parse("block_sparse_moe.gate") is None and spec.experts.parse("self_attn.q_proj") is None
    assert spec.float_linears() == ("block_sparse_moe.gate",)
    assert spec.order_of("self_attn.o_proj") < spec.order_of("block_sparse_moe.experts.0.w2") \
        < spec.order_of("block_sparse_moe.experts.1.w1")


@pytest.mark.parametrize("extra, what", [({"mlp_only_layers": [1]}, "dense MLP layers"),
                                         ({"decoder_sparse_step": 2}, "dense MLP layers"),
                                         ({"shared_expert_intermediate_size": 64}, "shared experts")])
def test_moe_layouts_the_spec_does_not_describe_are_one_line_errors(extra, what):
    with pytest.raises(QuantkitError, match=what):
        spec_for({"architectures": ["Qwen3MoeForCausalLM"], **extra})


def test_an_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(QuantkitError) as e:
        spec_for({"architectures": ["FalconForCausalLM"]})
    assert "\n" not in str(e.value) and "MixtralForCausalLM" in str(e.value) and "Gemma3ForCausalLM" in str(e.value)
