"""The Triton kernels compiled on a GPU (`pytest -m gpu`; `bash kernels/gpu_check.sh` runs them):
the W4A16 GEMM at a Llama shape, autotuned, in fp16, and the paged decode attention, each against
its pure-torch reference. `gpu_check --dry-run` runs the same tests at toy sizes on CPU tensors in
Triton's interpreter (the `gpu_device` fixture in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quantkit.kernels import w4a16_matmul  # noqa: E402
from quantkit.kernels.paged_attention_reference import paged_decode_attention_reference  # noqa: E402
from quantkit.kernels.triton_w4a16 import private_copy  # noqa: E402
from tests_support.kernel_inputs import random_packed, random_paged  # noqa: E402

pytestmark = pytest.mark.gpu


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("m", [1, 16, 256])
def test_w4a16_kernel_matches_reference(gpu_device, layout, m):
    k, n, group = (4096, 4096, 128) if on_gpu(gpu_device) else (256, 64, 64)  # a Llama-2-7B q/k/v/o linear
    dtype = torch.float16 if on_gpu(gpu_device) else torch.float32
    p = random_packed(layout, group, act_order=False, n=n, k=k, seed=m)
    args = [t.to(gpu_device) for t in (p.qweight, p.qzeros, p.scales.to(dtype))]
    # x: [M, K]; the reference dequantizes in fp32 on the same device
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 0.1).to(gpu_device, dtype)
    g_idx = None if p.g_idx is None else p.g_idx.to(gpu_device)  # AWQ stores none
    got = w4a16_matmul(x, *args, layout=layout, group_size=group, g_idx=g_idx, backend="triton")
    want = w4a16_matmul(x.float(), args[0], args[1], args[2].float(), layout=layout, group_size=group, g_idx=g_idx,
                        backend="torch")
    assert got.shape == (m, n) and got.dtype == dtype and got.device.type == gpu_device.type
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("heads,kv_heads,d", [(32, 4, 64), (32, 8, 128)])
def test_paged_decode_kernel_matches_reference(gpu_device, heads, kv_heads, d):
    if on_gpu(gpu_device):
        from quantkit.kernels.paged_attention import paged_decode_attention  # compiled
        seq_lens, dtype = [1, 15, 16, 17, 300, 1000], torch.float16
    else:
        paged_decode_attention = private_copy("quantkit.kernels.paged_attention", interpret=True).paged_decode_attention
        heads, kv_heads, d, seq_lens, dtype = heads // 8, kv_heads // 4 or 1, d // 4, [1, 17, 40], torch.float32
    block_size = 16
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    kc, vc, tables, _ = random_paged(seq_lens, heads, kv_heads, d, block_size, num_blocks, seed=2)
    q = torch.randn(len(seq_lens), heads, d, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = [t.to(gpu_device) for t in (q.to(dtype), kc.to(dtype), vc.to(dtype), tables, lens)]
    got = paged_decode_attention(*dev, d ** -0.5)
    want = paged_decode_attention_reference(q.to(dtype).float(), kc.to(dtype).float(), vc.to(dtype).float(), tables,
                                            lens, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
