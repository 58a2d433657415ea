"""An MoE layer's experts go to the shard writer as each is quantized (quantkit/quant/layer_step.py with
moe_experts.MoEContext.expert_done), so a layer's integer weights never wait together; the checkpoint is the one
the layer-at-a-time path writes, tensor for tensor."""

from __future__ import annotations

import json
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file

from quantkit.config import CalibConfig, QuantizeConfig
from quantkit.format.primitives import QuantizedWeight
from quantkit.quant import layer_step, pipeline
from quantkit.quant.shard_writer import ShardWriter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")


def quantize(model, out, method: str, layout: str, calib, max_shard_size: int = 2 * 1024**3):
    out.mkdir()
    cfg = QuantizeConfig(model=str(model), out=out, method=method, format=layout, bits=4, group_size=32,
                         calib=CalibConfig(source=str(calib), nsamples=8, seqlen=64), device="cpu",
                         max_shard_size=max_shard_size)
    pipeline.quantize_model(cfg, out_dir=out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    from quantkit.calibration.synthetic import make_corpus

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(make_corpus(64, seed=1)))
    return path


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read through the index (which must name each shard's tensors)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        part = load_file(folder / shard)
        assert {k for k, v in index.items() if v == shard} == set(part)
        tensors.update(part)
    return tensors


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_each_expert_is_written_when_quantized_with_one_experts_codes_alive(tiny_family, calib, tmp_path,
                                                                           monkeypatch, method):
    """A writer spy: each expert's packed linears arrive in an add of their own, in expert order, before the
    layer's float tensors; at each of those adds, only the dense linears' and this expert's integer weights exist."""
    alive = weakref.WeakValueDictionary()  # QuantizedWeight (a dataclass) is unhashable: keyed by id
    post_init = QuantizedWeight.__post_init__

    def tracked(self):
        post_init(self)
        alive[id(self)] = self

    adds = []
    add = ShardWriter.add

    def spy(self, tensors):
        adds.append((sorted(tensors), len(alive)))
        return add(self, tensors)

    monkeypatch.setattr(QuantizedWeight, "__post_init__", tracked)
    monkeypatch.setattr(ShardWriter, "add", spy)
    layout = "awq" if method == "awq" else "gptq"
    quantize(tiny_family("qwen3_moe"), tmp_path / "out", method, layout, calib)
    dense = 4  # q, k, v, o: their integer weights wait for the end of the layer
    for layer in range(2):
        expert_adds = [(names, live) for names, live in adds
                       if names and all((m := EXPERT.match(n)) and int(m[1]) == layer for n in names)]
        assert [{int(EXPERT.match(n)[2]) for n in names} for names, _ in expert_adds] == [{e} for e in range(8)]
        assert all({EXPERT.match(n)[3] for n in names} == {"gate", "up", "down"} for names, _ in expert_adds)
        assert max(live for _, live in expert_adds) <= dense + 3
        layer_add = next(i for i, (names, _) in enumerate(adds)
                         if f"model.layers.{layer}.post_attention_layernorm.weight" in names)
        assert adds.index(expert_adds[-1]) < layer_add
        assert not any(EXPERT.match(n) for n in adds[layer_add][0])


@pytest.mark.parametrize("method,layout", [("rtn", "gptq"), ("gptq", "gptq"), ("awq", "awq"),
                                           ("gptq", "compressed-tensors")])
def test_experts_written_early_make_the_checkpoint_of_the_layer_at_a_time_path(tiny_family, calib, tmp_path,
                                                                              monkeypatch, method, layout):
    """Bit for bit, tensor by tensor (their order in the shards differs), against the pipeline with every expert
    loaded with its layer (none read on its turn, the layer re-run through its experts rather than replayed) and no
    sink (every expert packed at the end of its layer), in small shards so that the index spans several."""
    model = tiny_family("qwen3_moe")
    early = checkpoint_tensors(quantize(model, tmp_path / "early", method, layout, calib, 200_000))
    streamed = layer_step.quantize_experts

    def at_layer_end(ctx, method_, calibrated, sink=None, loader=None, propagate=False):
        assert loader is None
        return streamed(ctx, method_, calibrated)

    monkeypatch.setattr(layer_step, "quantize_experts", at_layer_end)
    monkeypatch.setattr(layer_step, "streamed_expert_linears", lambda *args: frozenset())
    late = checkpoint_tensors(quantize(model, tmp_path / "late", method, layout, calib, 200_000))
    assert len(list((tmp_path / "early").glob("model-*.safetensors"))) > 1
    assert set(early) == set(late) and any(EXPERT.match(k) for k in early)
    for name, t in late.items():
        assert early[name].dtype == t.dtype and torch.equal(early[name], t), name
