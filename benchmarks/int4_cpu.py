"""4-bit linears on CPU, one process: quantkit's kernel (AVX2, or AVX-512 BF16 for bf16 activations where
built), its dequantize-a-tile-then-matmul path, torch's int4pack kernel, and dense (oneDNN prepacked) in
the activations' dtype, with ratios to dense.

  python benchmarks/int4_cpu.py [--threads 2] [--shapes 1024x2816,2816x1024,1024x1024,4096x4096]
                                    [--ms 1,8,64,256] [--group-size 128] [--int4pack-max-m 8]
                                    [--dtype float32|bfloat16] [--cold-copies 16]

Shapes are N x K (out x in features). Times are the best of --reps calls, in ms. The last column is
the path `int4_blocked_linear` picks at that M (kernel below `dense_threshold`, dense tiles from it).
--cold-copies N times instead the kernel and the dense bf16/fp32 linear over a ring of N different
weights of each shape, called in turn, so that each call reads its weight from memory as in a model
(the table above reuses one weight, which stays in the cache); it prints ms per call and the weight
bytes read per second, beside the streaming read's bound measured just before each shape (the host's memory
bandwidth drifts), and with bf16 activations the int8-activation (W4A8) kernel's time where it builds.
"""

from __future__ import annotations

import argparse
import os

import torch


def _time(fn, reps: int) -> float:
    from quantkit.kernels.cpu_int import best_ms

    return best_ms(fn, reps)


def bench_shape(n: int, k: int, ms: list[int], group_size: int, int4pack_max_m: int, reps: int,
                dtype: torch.dtype) -> None:
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize
    from quantkit.kernels.cpu_int import int4_linear, repack_int4
    from quantkit.kernels.cpu_linear import PrepackedLinear
    from quantkit.kernels.int4_cpu import amx_kernel, bf16_kernel, dense_threshold, int4_blocked_linear, repack

    linear = torch.nn.Linear(k, n, bias=False)
    p = pack(rtn_quantize(linear.weight.detach(), QuantScheme(4, group_size, True)), "gptq")
    dense = PrepackedLinear(linear.to(dtype))
    ours, theirs = repack(p), repack_int4(p, dtype)
    kernel_bf16 = dtype == torch.bfloat16 and bf16_kernel(ours)
    amx = kernel_bf16 and amx_kernel(ours)
    threshold = dense_threshold(dtype, kernel_bf16, amx)
    kernel = ("AMX tiles where they apply, else AVX-512 BF16" if amx else "AVX-512 BF16") if kernel_bf16 else "AVX2"
    print(f"\n[{n} x {k}] group {group_size}, {dtype} activations; kernel: {kernel}, "
          f"dense tiles from M = {threshold}")
    # also the int8-activation kernel (W4A8, `--cpu-int8-activations`) at every M, where it builds
    q8 = _q8_call(ours, max(ms) + 1, dtype)
    print(f"{'M':>5} {'ours':>9} {'ours dense-tile':>15} {'torch int4pack':>14} {'dense prepacked':>15} "
          f"{'dense/ours':>10} {'int4pack/ours':>13}" + (f" {'W4A8':>9} {'ours/W4A8':>9}" if q8 else "") + "  picks")
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        kern = _time(lambda: int4_blocked_linear(x, ours, None, dense_from_m=m + 1), reps)
        tiles = _time(lambda: int4_blocked_linear(x, ours, None, dense_from_m=0), reps)
        tp = _time(lambda: int4_linear(x, theirs, None, kernel_max_m=m), 1) if m <= int4pack_max_m else None
        fp = _time(lambda: dense(x), reps)
        best = kern if m < threshold else tiles
        picks = "kernel" if m < threshold else "dense-tile"
        tp_s = f"{tp:>14.3f}" if tp is not None else f"{'-':>14}"
        ratio = f"{tp / best:>13.1f}" if tp is not None else f"{'-':>13}"
        w4a8 = f" {(q := _time(lambda: q8(x), reps)):>9.3f} {best / q:>9.2f}" if q8 else ""
        print(f"{m:>5} {kern:>9.3f} {tiles:>15.3f} {tp_s} {fp:>15.3f} {fp / best:>10.2f} {ratio}{w4a8}  {picks}",
              flush=True)


def _q8_call(w, m_max: int, dtype: torch.dtype):
    """The int8-activation kernel's direct call on `w` for `dtype` activations (bf16: AVX-512 VNNI; fp32: AVX2), or
    None where it is not built or does not take the weight."""
    from quantkit.kernels.int4_cpu import direct_call, extension, q8_kernel

    built = q8_kernel(w) if dtype == torch.bfloat16 else hasattr(extension(), "int4_linear_q8_f32") \
        and w.group_size % 4 == 0
    return direct_call(w, "q8", m_max, dtype) if built else None


def _bound() -> str:
    """The streaming read's GB/s at torch's threads, measured now: the shared host's memory bandwidth drifts, so the
    cold rows' GB/s compare with this figure of the same run only."""
    from quantkit.kernels.stream_read import stream_read_bandwidth, unavailable

    if (why := unavailable()) is not None:
        return f"no bandwidth bound ({why})"
    return f"streaming read {stream_read_bandwidth(torch.get_num_threads(), 1.0, 3) / 1e9:.1f} GB/s"


def bench_cold(n: int, k: int, ms: list[int], group_size: int, copies: int, reps: int, dtype: torch.dtype) -> None:
    """The int4 kernel and the dense prepacked linear, each over a ring of `copies` weights of N x K."""
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize
    from quantkit.kernels.cpu_linear import PrepackedLinear
    from quantkit.kernels.int4_cpu import int4_blocked_linear, repack

    packed, dense = [], []
    for _ in range(copies):
        linear = torch.nn.Linear(k, n, bias=False)
        packed.append(repack(pack(rtn_quantize(linear.weight.detach(), QuantScheme(4, group_size, True)), "gptq")))
        dense.append(PrepackedLinear(linear.to(dtype)))
    int4_mb, dense_mb = n * k / 2 / 1e6, n * k * dtype.itemsize / 1e6
    print(f"\n[{n} x {k}] group {group_size}, {dtype} activations, a ring of {copies} weights "
          f"({copies * int4_mb:.0f} MB int4, {copies * dense_mb:.0f} MB dense); {_bound()}")
    # also the int8-activation kernel (W4A8) through its direct call, where it builds
    q8 = [_q8_call(w, max(ms) + 1, dtype) for w in packed] if _q8_call(packed[0], 1, dtype) else None
    print(f"{'M':>5} {'int4 ms':>9} {'int4 GB/s':>9} {'dense ms':>9} {'dense GB/s':>10} {'dense/int4':>10}"
          + (f" {'W4A8 ms':>9} {'int4/W4A8':>9}" if q8 else ""))
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        kern = _time(lambda: [int4_blocked_linear(x, w, None, dense_from_m=m + 1) for w in packed], reps) / copies
        fp = _time(lambda: [d(x) for d in dense], reps) / copies
        line = f"{m:>5} {kern:>9.3f} {int4_mb / kern:>9.1f} {fp:>9.3f} {dense_mb / fp:>10.1f} {fp / kern:>10.2f}"
        if q8:
            w4a8 = _time(lambda: [call(x) for call in q8], reps) / copies
            line += f" {w4a8:>9.3f} {kern / w4a8:>9.2f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="1024x2816,2816x1024,1024x1024,4096x4096")
    ap.add_argument("--ms", default="1,8,64,256")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--int4pack-max-m", type=int, default=8, help="largest M to time torch's int4pack at (slow)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the activations' dtype")
    ap.add_argument("--cold-copies", type=int, default=0, help="time a ring of this many weights per shape (cold)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    from quantkit.kernels.int4_cpu import unavailable

    if (why := unavailable()) is not None:
        raise SystemExit(f"the int4 CPU kernel is unavailable: {why}")
    print(f"{args.dtype} activations, {args.threads} threads, best of {args.reps} (ms); load average "
          f"{os.getloadavg()[0]:.2f}; ratios are against ours at the path it picks")
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            if args.cold_copies:
                bench_cold(n, k, [int(m) for m in args.ms.split(",")], args.group_size, args.cold_copies, args.reps,
                           dtype)
                continue
            bench_shape(n, k, [int(m) for m in args.ms.split(",")], args.group_size, args.int4pack_max_m, args.reps,
                        dtype)


if __name__ == "__main__":
    main()
