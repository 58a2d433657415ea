"""ShardReader: header-only shapes, exact reads, and pages released after each read."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader


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
