"""A checkpoint that stacks its experts (gpt-oss) read one linear per expert: each expert's tensors are its slice of
the stacked one, as a linear holds it ([out, in], gate/up rows interleaved as stored), read alone; the rest as
stored."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.arch import spec_for
from quantkit.model.checkpoint import ShardReader
from quantkit.model.stacked_experts import PerExpertReader


def test_each_expert_reads_its_slice_of_the_stacked_tensors_as_a_linear(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    layer = "model.layers.4.mlp.experts."
    stacked = {layer + "gate_up_proj": torch.randn(3, 8, 10, generator=g),  # [E, in, out]: g0, u0, g1, u1, ...
               layer + "gate_up_proj_bias": torch.randn(3, 10, generator=g),
               layer + "down_proj": torch.randn(3, 5, 8, generator=g), layer + "down_proj_bias": torch.randn(3, 8),
               "model.layers.4.mlp.router.weight": torch.randn(3, 8, generator=g)}
    save_file(stacked, str(tmp_path / "model.safetensors"))
    reader = PerExpertReader(ShardReader(tmp_path), spec_for({"architectures": ["GptOssForCausalLM"]}).experts)
    assert sorted(reader.keys()) == sorted(["model.layers.4.mlp.router.weight"] + [
        f"{layer}{e}.{p}.{t}" for e in range(3) for p in ("gate_up_proj", "down_proj") for t in ("weight", "bias")])
    assert layer + "gate_up_proj" not in reader and f"{layer}2.down_proj.bias" in reader
    assert reader.shape_of(f"{layer}1.gate_up_proj.weight") == (10, 8) and reader.shape_of(f"{layer}1.down_proj.bias") == (8,)
    x = torch.randn(4, 8, generator=g)
    for e in range(3):
        linear = torch.nn.functional.linear(x, reader.get(f"{layer}{e}.gate_up_proj.weight"),
                                            reader.get(f"{layer}{e}.gate_up_proj.bias"))
        torch.testing.assert_close(linear, x @ stacked[layer + "gate_up_proj"][e] + stacked[layer + "gate_up_proj_bias"][e])
        h = torch.randn(4, 5, generator=g)
        torch.testing.assert_close(h @ reader.get(f"{layer}{e}.down_proj.weight").t(), h @ stacked[layer + "down_proj"][e])
    assert torch.equal(reader.get("model.layers.4.mlp.router.weight"), stacked["model.layers.4.mlp.router.weight"])
    assert not reader.aligned(f"{layer}0.down_proj.weight")
    with pytest.raises(QuantkitError, match="one expert's part of a stacked tensor"):
        reader.entry(f"{layer}0.down_proj.weight")


def test_only_families_that_stack_their_experts_are_read_per_expert(tiny_family):
    from quantkit.model.source import open_model

    assert isinstance(open_model(tiny_family("gpt_oss")).reader, PerExpertReader)
    assert type(open_model(tiny_family("mixtral")).reader) is ShardReader
