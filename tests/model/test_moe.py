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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_linearized_block_computes_transformers_block(family, tiny_family, one_torch_thread):
    """load_model replaces transformers' MoE block by SparseMoeBlock under the checkpoint's names: the logits of
    the whole model are transformers', bit for bit (on one thread: at two, oneDNN may split an expert's [n, H] @ [H, I]
    differently from transformers' matmul of the same rows, and the sums then differ in the last bits). gpt-oss's
    stacked experts, read one linear each (quantkit.model.stacked_experts): transformers computes x @ W[e] + b on the
    stacked [H, 2I] slice, a linear its transpose with the bias fused, so equal to rounding."""
    from transformers import AutoModelForCausalLM

    from quantkit.model.loader import load_model
    from quantkit.model.moe import SparseMoeBlock

    path = tiny_family(family)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours, _ = load_model(path)
    assert all(isinstance(m, SparseMoeBlock) for m in (layer.mlp for layer in ours.model.layers))
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    if family == "gpt_oss":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_mixtrals_block_keeps_the_checkpoint_name_once(tiny_family):
    """Mixtral's block is `block_sparse_moe` in checkpoints and `mlp` to transformers 5's layer: the state dict names
    it once, the checkpoint's way."""
    from quantkit.model.loader import load_model

    model, _ = load_model(tiny_family("mixtral"))
    keys = list(model.state_dict())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert not any(".mlp." in k for k in keys)
    assert model.model.layers[0].mlp is model.model.layers[0].block_sparse_moe
