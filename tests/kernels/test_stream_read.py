"""The streaming-read kernel of the bandwidth bound (quantkit.kernels.stream_read) against its pure-torch reference:
the same wrapped sum of 32-bit words for every thread count and for lengths that leave a tail past the last whole
line or split unevenly between threads."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import stream_read


@pytest.fixture(scope="module")
def ext():
    if stream_read.unavailable() is not None:
        pytest.skip(f"streaming-read kernel not built: {stream_read.unavailable()}")
    return stream_read.extension()


@pytest.mark.parametrize("nbytes", [4, 60, 64, 68, 64 * 8 * 3 + 4 * 7, 1 << 20, (1 << 22) + 64 * 5 + 12])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_sum_matches_the_reference(ext, nbytes, threads):
    g = torch.Generator().manual_seed(nbytes + threads)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    want = stream_read.read_sum_reference(buf)
    assert ext.read_sum(buf, threads) == want
    for ahead in stream_read.PREFETCH_DISTANCES:  # prefetches past the buffer's end never fault
        assert stream_read.read_sum(buf, threads, ahead) == want, ahead


def test_the_sum_wraps_modulo_2_to_the_32(ext):
    buf = torch.full((1 << 16,), 0xFF, dtype=torch.uint8)  # 16384 words of 2^32 - 1
    assert stream_read.read_sum_reference(buf) == (16384 * (2**32 - 1)) % 2**32 == ext.read_sum(buf, 2)


def test_bad_buffers_are_refused_with_a_message(ext):
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ext.read_sum(torch.zeros(6, dtype=torch.uint8), 1)
    with pytest.raises(RuntimeError, match="uint8"):
        ext.read_sum(torch.zeros(8, dtype=torch.float32), 1)
    with pytest.raises(RuntimeError, match="prefetch distance"):
        ext.read_sum(torch.zeros(8, dtype=torch.uint8), 1, -64)
    with pytest.raises(ValueError, match="multiple of 4"):
        stream_read.read_sum_reference(torch.zeros(6, dtype=torch.uint8))


def test_bandwidth_is_a_plausible_rate_and_the_best_distance(ext):
    rates = stream_read.stream_read_rates(threads=1, gib=0.25, repeats=2, distances=(0, 4096))
    assert set(rates) == {0, 4096} and all(1e8 < r < 1e13 for r in rates.values())
    assert 1e8 < stream_read.stream_read_bandwidth(threads=1, gib=0.25, repeats=2) < 1e13
