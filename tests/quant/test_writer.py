"""ShardWriter streams tensors into safetensors shards that safetensors itself reads back exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.model.checkpoint import ShardReader
from quantkit.quant.writer import ShardWriter


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l{seed}.qweight": torch.randint(-2**31, 2**31 - 1, (5, 24), generator=g, dtype=torch.int32),
        f"l{seed}.scales": torch.randn(3, 24, generator=g).half(),
        f"l{seed}.norm": torch.randn(7, generator=g).bfloat16(),  # odd byte count
        f"l{seed}.fp32": torch.randn(3, 5, generator=g),
        f"l{seed}.flag": torch.tensor([True, False, True]),
        f"l{seed}.empty": torch.zeros(0, 4),
        f"l{seed}.scalar": torch.tensor(2.5),
    }


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 300])
def test_shards_round_trip_through_safetensors_and_our_reader(tmp_path, max_shard_bytes):
    expected = {}
    writer = ShardWriter(tmp_path, max_shard_bytes)
    for seed in range(4):
        tensors = mixed_tensors(seed)
        writer.add(tensors)
        expected.update(tensors)
    names = writer.finish()
    assert (len(names) == 1) == (max_shard_bytes == 1 << 30)
    assert not list(tmp_path.glob("*.tmp"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    loaded = {}
    for name in names:
        loaded.update(load_file(str(tmp_path / name)))
        assert (tmp_path / name).stat().st_size <= max_shard_bytes + 4096 or len(names) == 1
    reader = ShardReader(tmp_path)
    for key, t in expected.items():
        assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
        assert reader.get(key).dtype == t.dtype and torch.equal(reader.get(key), t), key
        assert reader.shape_of(key) == tuple(t.shape)
    reader.close()


def test_a_writer_given_nothing_writes_an_empty_shard(tmp_path):
    assert ShardWriter(tmp_path, 1 << 20).finish() == ["model.safetensors"]
    assert load_file(str(tmp_path / "model.safetensors")) == {}
