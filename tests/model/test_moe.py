"""quantkit.model.moe: routing and grouping as pure functions, and the per-expert block against transformers' own
MoE blocks (experts stacked in 3-D tensors), bit for bit."""

from __future__ import annotations

import pytest
import torch

from quantkit.model.moe import expert_batches, route


def test_route_takes_the_top_k_of_the_softmax_and_renormalizes_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    w, e = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert e.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(w, probs.gather(1, e))
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(2))


def test_expert_batches_group_tokens_by_expert_in_ascending_order():
    experts = torch.tensor([[2, 0], [0, 3], [2, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    batches = expert_batches(weights, experts, num_experts=5)
    assert [b.expert for b in batches] == [0, 2, 3]  # experts 1 and 4 got no token
    assert [b.rows.tolist() for b in batches] == [[0, 1], [0, 2], [1, 2]]
    assert [b.weights.tolist() for b in batches] == [pytest.approx(w) for w in ([0.4, 0.7], [0.6, 0.5], [0.3, 0.5])]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_linearized_block_computes_transformers_block(family, tiny_family, one_torch_thread):
    """load_model replaces transformers' MoE block by SparseMoeBlock under the checkpoint's names: the logits of
    the whole model are transformers', bit for bit (on one thread: at two, oneDNN may split an expert's [n, H] @ [H, I]
    differently from transformers' matmul of the same rows, and the sums then differ in the last bits)."""
    from transformers import AutoModelForCausalLM

    from quantkit.model.loader import load_model
    from quantkit.model.moe import SparseMoeBlock

    path = tiny_family(family)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours, _ = load_model(path)
    assert all(isinstance(m, SparseMoeBlock) for m in (layer.mlp for layer in ours.model.layers))
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, ours(ids).logits)


def test_mixtrals_block_keeps_the_checkpoint_name_once(tiny_family):
    """Mixtral's block is `block_sparse_moe` in checkpoints and `mlp` to transformers 5's layer: the state dict names
    it once, the checkpoint's way."""
    from quantkit.model.loader import load_model

    model, _ = load_model(tiny_family("mixtral"))
    keys = list(model.state_dict())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert not any(".mlp." in k for k in keys)
    assert model.model.layers[0].mlp is model.model.layers[0].block_sparse_moe


def test_stacked_experts_become_one_linear_per_expert_with_gate_and_up_in_halves():
    """gpt-oss's checkpoint stacks each projection of all experts ([E, in, out], gate/up columns interleaved): one
    linear's tensors per expert, [out, in], gate's rows then up's, computing what the stack computes."""
    from quantkit.format.arch import spec_for
    from quantkit.model.moe import unstack_experts

    spec = spec_for({"architectures": ["GptOssForCausalLM"]}).experts
    g = torch.Generator().manual_seed(0)
    gate_up, gate_up_bias = torch.randn(3, 8, 10, generator=g), torch.randn(3, 10, generator=g)
    down = torch.randn(3, 5, 8, generator=g)
    layer = "model.layers.4.mlp.experts."
    weights = unstack_experts(spec, layer + "gate_up_proj", gate_up)
    biases = unstack_experts(spec, layer + "gate_up_proj_bias", gate_up_bias)
    downs = unstack_experts(spec, layer + "down_proj", down)
    assert sorted(weights) == [f"{layer}{e}.gate_up_proj.weight" for e in range(3)]
    assert sorted(downs) == [f"{layer}{e}.down_proj.weight" for e in range(3)]
    x = torch.randn(4, 8, generator=g)
    for e in range(3):
        stacked = x @ gate_up[e] + gate_up_bias[e]  # [4, 10]: g0, u0, g1, u1, ...
        fused = torch.nn.functional.linear(x, weights[f"{layer}{e}.gate_up_proj.weight"],
                                           biases[f"{layer}{e}.gate_up_proj.bias"])
        gate, up = fused.chunk(2, dim=-1)
        torch.testing.assert_close(gate, stacked[:, 0::2])
        torch.testing.assert_close(up, stacked[:, 1::2])
        h = torch.randn(4, 5, generator=g)
        torch.testing.assert_close(h @ downs[f"{layer}{e}.down_proj.weight"].t(), h @ down[e])
    assert unstack_experts(spec, "model.layers.4.mlp.router.weight", torch.zeros(3, 8)) is None
    assert unstack_experts(spec_for({"architectures": ["MixtralForCausalLM"]}).experts, layer + "gate_up_proj",
                           gate_up) is None
