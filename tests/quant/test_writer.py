"""ShardWriter streams tensors into safetensors shards that safetensors itself reads back exactly, each byte written
once, and leaves no temporary file behind when it fails."""

import errno
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.model.checkpoint import ShardReader
from quantkit.quant import shard_writer
from quantkit.quant.shard_writer import ShardWriter, header_reserve


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


def header_of(path) -> tuple[int, bytes]:
    """A shard's u64 header length and its JSON header bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n]


def big_tensors(count: int, numel: int, name_len: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return {f"{'x' * name_len}.{i}": torch.randn(numel, generator=g) for i in range(count)}


def written(tmp_path, tensors: dict[str, torch.Tensor], max_shard_bytes: int):
    with ShardWriter(tmp_path, max_shard_bytes) as writer:
        writer.add(tensors)
        assert writer.finish() == ["model.safetensors"]
    return tmp_path / "model.safetensors"


def assert_reads_back(path, tensors: dict[str, torch.Tensor]) -> None:
    loaded = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
    reader = ShardReader(path.parent)
    for key, t in tensors.items():
        assert torch.equal(loaded[key], t) and torch.equal(reader.get(key), t), key
    reader.close()


def test_a_large_shard_keeps_its_reserved_header_padded_with_spaces(tmp_path):
    reserve = header_reserve(4 << 20)  # 4 KiB: the data (1 MiB) is 256x the reserve, so the padding is kept
    tensors = big_tensors(4, 1 << 16)
    path = written(tmp_path, tensors, 4 << 20)
    n, header = header_of(path)
    assert reserve == 4096 and n == reserve - 8
    assert header.endswith(b" ") and json.loads(header)["__metadata__"] == {"format": "pt"}
    assert path.stat().st_size == reserve + (1 << 20)
    assert_reads_back(path, tensors)


def test_a_header_too_long_for_its_reserve_moves_the_data_after_it(tmp_path):
    tensors = big_tensors(200, 1024, name_len=60)  # about 18 KB of header against a 4 KiB reserve
    path = written(tmp_path, tensors, 4 << 20)
    n, header = header_of(path)
    assert n > header_reserve(4 << 20) and n % 8 == 0 and len(header.rstrip()) > n - 8
    assert path.stat().st_size == 8 + n + 200 * 1024 * 4
    assert_reads_back(path, tensors)


def test_a_small_shard_is_laid_out_as_if_its_header_came_first(tmp_path):
    tensors = mixed_tensors(0)  # ~300 bytes of data: a 1 MiB reserve would be mostly spaces
    path = written(tmp_path, tensors, 1 << 30)
    n, header = header_of(path)
    assert n == len(header.rstrip()) + (-len(header.rstrip()) % 8)  # padded to 8 bytes, no more
    assert path.stat().st_size == 8 + n + sum(t.numel() * t.element_size() for t in tensors.values())
    assert_reads_back(path, tensors)


@pytest.mark.parametrize("kernel_copy", ["copy_file_range", "unsupported"])
def test_stored_tensors_are_copied_byte_for_byte(tmp_path, monkeypatch, kernel_copy):
    if kernel_copy == "unsupported":  # another file system: the copy goes through a buffer
        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(shard_writer.os, "copy_file_range", refuse, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    tensors = {"emb": torch.randn(300, 7).bfloat16(), "norm": torch.randn(5), "ids": torch.arange(9, dtype=torch.int32)}
    save_file(tensors, str(src / "model.safetensors"))
    reader = ShardReader(src)
    out = tmp_path / "out"
    out.mkdir()
    with ShardWriter(out, 1 << 20) as writer:
        for key in reader.keys():
            writer.add_stored(key, reader.entry(key), reader.path)
        writer.finish()
    reader.close()
    assert_reads_back(out / "model.safetensors", tensors)


def test_a_shard_failing_as_it_closes_leaves_no_file(tmp_path, monkeypatch):
    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    writer = ShardWriter(tmp_path, 4 << 20)
    writer.add(big_tensors(2, 1024))
    monkeypatch.setattr(shard_writer.os, "pwrite", disk_full)
    with pytest.raises(OSError, match="No space"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_writing_removes_every_unfinished_shard(tmp_path):
    with pytest.raises(RuntimeError, match="quantizer failed"):
        with ShardWriter(tmp_path, 300) as writer:
            for seed in range(3):  # several shards closed, one open
                writer.add(mixed_tensors(seed))
            assert len(list(tmp_path.glob("*.tmp"))) > 1
            raise RuntimeError("quantizer failed")
    assert list(tmp_path.iterdir()) == []
