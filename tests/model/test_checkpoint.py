"""ShardReader: header-only shapes, exact reads, and pages released after each read."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader
from tests_support.peak_rss import peak_rss_kib, reset_peak_rss_kib


def rss_file_kib() -> int:
    """Resident file-backed pages of this process (mapped files), from /proc."""
    status = Path("/proc/self/status")
    if not status.is_file() or "RssFile" not in status.read_text():
        pytest.skip("needs Linux /proc/self/status with RssFile to observe mapped pages")
    return int(re.search(r"RssFile:\s+(\d+) kB", status.read_text()).group(1))


def test_reading_every_tensor_does_not_keep_the_file_resident(tmp_path):
    # 16 tensors of 4 MiB: reading them all through a mapping that kept its pages would hold 64 MiB
    save_file({f"layers.{i}.w": torch.full((1024, 1024), float(i)) for i in range(16)}, str(tmp_path / "m.safetensors"))
    reader = ShardReader(tmp_path)
    before = rss_file_kib()
    for i in range(16):
        t = reader.get(f"layers.{i}.w")
        assert t.shape == (1024, 1024) and bool((t == i).all())
        del t
    grown_mib = (rss_file_kib() - before) / 1024
    reader.close()
    assert grown_mib < 8, f"mapped pages kept resident: {grown_mib:.1f} MiB"


def test_shapes_and_dtypes_come_from_the_header(tmp_path):
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.int32)},
              str(tmp_path / "m.safetensors"))
    reader = ShardReader(tmp_path)
    assert reader.shape_of("a") == (3, 5) and reader.dtype_of("a") == torch.bfloat16
    assert reader.shape_of("b") == (2,) and reader.dtype_of("b") == torch.int32
    with pytest.raises(QuantkitError, match="tensor c is missing"):
        reader.get("c")


def test_a_header_that_does_not_match_its_data_is_corrupt(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4, 4)}, str(f))
    data = f.read_bytes()
    f.write_bytes(data.replace(b'"shape":[4,4]', b'"shape":[4,5]'))
    with pytest.raises(QuantkitError, match="corrupt safetensors"):
        ShardReader(tmp_path)


def test_a_mapped_tensor_reads_in_place_and_never_writes_the_file(tmp_path):
    table = torch.randn(300, 64).bfloat16()
    save_file({"a": torch.ones(3, dtype=torch.int8), "embed": table}, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    mapped = ShardReader(tmp_path).mapped("embed")
    assert mapped.dtype == torch.bfloat16 and torch.equal(mapped, table)
    assert torch.equal(torch.nn.functional.embedding(torch.tensor([5, 299]), mapped), table[[5, 299]])
    mapped[0] = 0  # a private copy-on-write mapping: the write stays in this process
    assert (tmp_path / "model.safetensors").read_bytes() == before


def rss_anon_kib() -> int:
    """Resident anonymous pages of this process (its own memory, not the page cache's), from /proc."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").is_file() else ""
    if "RssAnon" not in status:
        pytest.skip("needs Linux /proc/self/status with RssAnon")
    return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1))


def test_a_mapped_table_is_not_copied_into_process_memory(tmp_path):
    # (file pages a lookup maps may be whole large folios of the page cache: RssFile is not the measure here)
    save_file({"embed": torch.randn(16384, 1024)}, str(tmp_path / "model.safetensors"))  # 64 MiB
    before = rss_anon_kib()
    mapped = ShardReader(tmp_path).mapped("embed")
    rows = torch.nn.functional.embedding(torch.arange(0, 16384, 7), mapped)  # 2341 rows spread over the table
    assert rows.shape == (2341, 1024)
    del rows
    grown_mib = (rss_anon_kib() - before) / 1024
    assert grown_mib < 16, f"{grown_mib:.1f} MiB of process memory for a mapped 64 MiB table"


def write_misaligned_table(folder: Path, table: torch.Tensor) -> None:
    """model.safetensors with the bf16 `table` after a 3-byte tensor, written by hand (safetensors does not promise
    aligned offsets)."""
    import json
    import struct

    size = table.numel() * 2
    header = json.dumps({"a": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
                         "embed": {"dtype": "BF16", "shape": list(table.shape), "data_offsets": [3, 3 + size]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytes([1, 2, 3]) + table.view(torch.int16).numpy().tobytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_a_misaligned_tensor_is_read_not_mapped(tmp_path):
    table = torch.randn(4, 8).bfloat16()
    write_misaligned_table(tmp_path, table)
    reader = ShardReader(tmp_path)
    assert not reader.aligned("embed")
    with pytest.raises(QuantkitError, match="not aligned"):
        reader.mapped("embed")
    assert torch.equal(reader.get("embed"), table)  # read (copied) instead


def test_rows_are_the_tensors_rows_in_the_order_asked(tmp_path):
    """Rows read from the file (the calibration tokens' embeddings), repeats and any order, also from a tensor at an
    offset that is not a multiple of its element size; rows past the table and a scalar are refused."""
    table = torch.randn(40, 8).bfloat16()
    write_misaligned_table(tmp_path, table)
    index = torch.tensor([39, 0, 7, 7, 21])
    reader = ShardReader(tmp_path)
    rows = reader.rows("embed", index)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, table[index])
    with pytest.raises(QuantkitError, match="past its 40 rows"):
        reader.rows("embed", torch.tensor([3, 40]))
    save_file({"a": torch.tensor(1.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantkitError, match="a has no rows"):
        ShardReader(tmp_path).rows("a", index)


def test_reading_rows_never_holds_the_table_nor_its_pages(tmp_path):
    save_file({"embed": torch.randn(16384, 1024)}, str(tmp_path / "model.safetensors"))  # 64 MiB
    reader = ShardReader(tmp_path)
    before = reset_peak_rss_kib()
    rows = reader.rows("embed", torch.arange(0, 16384, 64))  # 256 rows: 1 MiB
    assert rows.shape == (256, 1024)
    grown_mib = (peak_rss_kib() - before) / 1024
    assert grown_mib < 8, f"reading 1 MiB of rows raised the peak by {grown_mib:.1f} MiB"
