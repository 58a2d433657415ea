"""Benchmark: quantkit's Triton W4A16 kernel against fp16 cuBLAS and torch dequantize-then-matmul.

    python -m quantkit.bench.w4a16                      # on a GPU: the full table
    python -m quantkit.bench.w4a16 --out bench.md       # also write the markdown table to a file

For each linear shape of Llama-2-7B and Llama-3-8B (K x N = in x out features) and each batch
M, it times, in one process on one device:
  ours      quantkit.kernels.w4a16_matmul(backend="triton") on the packed INT4 weight
  cublas    torch fp16 x @ W.T on the dense weight (cuBLAS)
  deq+mm    torch dequantize of the packed weight, then the same matmul (what a naive loader does)
and prints the speed-up of ours over cuBLAS (>1: ours is faster), over dequantize-then-matmul,
and our effective memory bandwidth (bytes the product must move / time) against the GPU's peak.
Before timing a shape, ours is checked against the dequantize-then-matmul output.

Goals on an H200: M <= 16 at least 3x faster than cuBLAS; M >= 1024 within 1.3x of cuBLAS.

--device cpu runs the same code with the kernels in Triton's interpreter (tiny shapes only):
that is how CI checks this script without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA_SHAPES = {  # (K, N): in_features x out_features
    "llama2-7b qkvo": (4096, 4096), "llama2-7b gate/up": (4096, 11008), "llama2-7b down": (11008, 4096),
    "llama3-8b gate/up": (4096, 14336), "llama3-8b down": (14336, 4096), "llama3-8b k/v": (4096, 1024),
}
BATCHES = (1, 4, 16, 64, 256, 1024, 4096)
PEAK_GBPS = {  # HBM/GDDR peak bandwidth by device name fragment (vendor data sheets)
    "H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555,
    "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008, "RTX 3090": 936,
}


@dataclass
class Row:
    shape: str
    k: int
    n: int
    m: int
    ours_ms: float
    cublas_ms: float
    deq_ms: float
    gbps: float

    @property
    def vs_cublas(self) -> float:
        return self.cublas_ms / self.ours_ms

    @property
    def vs_deq(self) -> float:
        return self.deq_ms / self.ours_ms


def make_weight(k: int, n: int, group: int, device: torch.device):
    """A random fp16 weight [N, K] and its GPTQ-v1 packed form (symmetric RTN), on `device`."""
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize

    w = torch.randn(n, k) * 0.02
    packed = pack(rtn_quantize(w, QuantScheme(bits=4, group_size=group, sym=True)), "gptq")
    to = lambda t: t.to(device)  # noqa: E731
    return w.half().to(device), to(packed.qweight), to(packed.qzeros), to(packed.scales)


def torch_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """GPTQ v1 qweight [K/8, N], qzeros [G, N/8], scales [G, N] -> W_hat.T [K, N] fp16, all in torch on device."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    codes = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    zeros = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF).reshape(qzeros.shape[0], -1) + 1  # [G, N]
    g = torch.arange(codes.shape[0], device=qweight.device) // group
    return ((codes - zeros[g]).to(scales.dtype) * scales[g])


def timer(device: torch.device, iters: int, cuda_graph: bool):
    """ms per call (median): on a GPU, CUDA events around a CUDA graph of many calls (no launch
    overhead, as a serving engine's decode step runs) or around plain calls; wall time on the CPU."""
    if device.type == "cuda":
        import triton

        if cuda_graph:
            return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn):
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters

    return wall


def bytes_moved(m: int, k: int, n: int, group: int) -> int:
    """Packed weight + zeros + fp16 scales + fp16 x + fp16 out: the minimum the product reads and writes."""
    groups = -(-k // group)
    return k * n // 2 + groups * n // 2 + groups * n * 2 + m * k * 2 + m * n * 2


def bench_shape(name: str, k: int, n: int, batches, group: int, device: torch.device, dtype: torch.dtype,
                measure) -> list[Row]:
    from quantkit.kernels import w4a16_matmul

    w, qweight, qzeros, scales = make_weight(k, n, group, device)
    # Copies of the weights, used in turn, so that (like a model's layers) each call reads its
    # weight from memory rather than from the L2 cache left warm by the previous call.
    copies = cache_busting_copies(w.to(dtype), qweight, qzeros, scales, device)  # scales fp16, as on disk
    turn = iter(range(10**12))
    pick = lambda: copies[next(turn) % len(copies)]  # noqa: E731
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=device).to(dtype)

        def ours():
            _, qw, qz, sc = pick()
            return w4a16_matmul(x, qw, qz, sc, layout="gptq", group_size=group, backend="triton")

        def deq():
            _, qw, qz, sc = pick()
            return x @ torch_dequantize(qw, qz, sc.to(x.dtype), group)

        def dense():
            return x @ pick()[0].T

        check = x @ torch_dequantize(qweight, qzeros, scales.to(dtype), group)
        got = w4a16_matmul(x, qweight, qzeros, scales, layout="gptq", group_size=group, backend="triton")
        torch.testing.assert_close(got.float(), check.float(), rtol=2e-2, atol=2e-2 * float(check.abs().max()))
        t_ours, t_cublas, t_deq = measure(ours), measure(dense), measure(deq)
        print(f"  {name} M={m}: ours {t_ours:.4f} ms, dense {t_cublas:.4f} ms", flush=True)  # how far a cut run got
        rows.append(Row(name, k, n, m, t_ours, t_cublas, t_deq, bytes_moved(m, k, n, group) / t_ours / 1e6))
    return rows


def cache_busting_copies(w, qweight, qzeros, scales, device: torch.device, total_bytes: int = 512 * 2**20):
    """Enough copies of the weight tensors that the dense ones add up to `total_bytes` (GPU only)."""
    if device.type != "cuda":
        return [(w, qweight, qzeros, scales)]
    count = max(1, min(64, -(-total_bytes // (w.numel() * w.element_size()))))
    return [(w, qweight, qzeros, scales)] + [
        (w.clone(), qweight.clone(), qzeros.clone(), scales.clone()) for _ in range(count - 1)]


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in PEAK_GBPS.items() if key in name), None)


def goal(m: int, vs_dense: float) -> str:
    """The issue's goals: M <= 16 at least 3x faster than cuBLAS; M >= 1024 within 1.3x of it."""
    if m <= 16:
        return f">= 3x: {'met' if vs_dense >= 3.0 else 'missed'}"
    if m >= 1024:
        return f">= 0.77x: {'met' if vs_dense >= 1 / 1.3 else 'missed'}"
    return ""


def markdown(rows: list[Row], peak: float | None, header: str, on_gpu: bool) -> str:
    dense = "cuBLAS" if on_gpu else "torch dense"
    lines = [header, "", f"| shape | K x N | M | ours ms | {dense} ms | deq+mm ms | vs {dense} | vs deq+mm "
             "| GB/s | % of peak | goal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pct = f"{100 * r.gbps / peak:.0f}%" if peak else "n/a"
        lines.append(f"| {r.shape} | {r.k} x {r.n} | {r.m} | {r.ours_ms:.4f} | {r.cublas_ms:.4f} | {r.deq_ms:.4f} "
                     f"| {r.vs_cublas:.2f}x | {r.vs_deq:.2f}x | {r.gbps:.0f} | {pct} "
                     f"| {goal(r.m, r.vs_cublas) if on_gpu else 'n/a (CPU)'} |")
    return "\n".join(lines) + "\n"


def describe(device: torch.device, dtype: torch.dtype, group: int, peak: float | None, graphs: bool) -> str:
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    return (f"W4A16 on {where}; torch {torch.__version__}, triton {triton.__version__}; x {str(dtype).removeprefix('torch.')}, GPTQ v1 layout, "
            f"group {group}, sym; {'CUDA graphs' if graphs and device.type == 'cuda' else 'plain calls'}; peak bandwidth {f'{peak:.0f} GB/s' if peak else 'unknown'}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (interpreter smoke run, tiny shapes)")
    p.add_argument("--shapes", default=None, help="comma list of KxN (default: the Llama-2-7B and Llama-3-8B linears)")
    p.add_argument("--m", default=",".join(map(str, BATCHES)), help="comma list of batch sizes M")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=3, help="timed calls per measurement on the CPU")
    p.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth")
    p.add_argument("--no-cuda-graph", action="store_true", help="time plain calls (launch overhead included)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (--device cpu only smoke-tests it)")
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 matmul on the CPU is unusably slow
    shapes = LLAMA_SHAPES if args.shapes is None else {
        s: tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")}
    batches = [int(m) for m in args.m.split(",")]
    peak = peak_gbps(device, args.peak_gbps)
    measure = timer(device, args.iters, cuda_graph=not args.no_cuda_graph)
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in shapes.items():
        rows += bench_shape(name, k, n, batches, args.group_size, device, dtype, measure)
        print(f"done {name} ({k} x {n})", flush=True)
        table = markdown(rows, peak, describe(device, dtype, args.group_size, peak, not args.no_cuda_graph),
                         device.type == "cuda")
        if args.out:  # after every shape: a run stopped by a time limit keeps the shapes it finished
            args.out.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
