"""An lm_head held in int8 on a CPU with native bf16: quantkit's int8 kernel (kernels/int8_cpu.py, groups of 128)
against oneDNN's prepacked bf16 linear and torch's `_weight_int8pack_mm` (per-row scales), one process.

  python -m quantkit.bench.int8_head [--threads 2] [--shape 32000x1024] [--ms 1,2,4,8,16,32] [--reps 20] [--rounds 3]

Shape is N x K (vocab x hidden); bf16 activations. Each time is the best of --reps calls (ms), per round; rounds
alternate the three and the best round counts. The ratios are bf16 / int8 (ours) and torch int8 / ours. Where the
AMX path is built and granted, ours runs it from 4 rows (int8_amx.h), and a fourth column times the same head with it
off (the AVX-512 VNNI kernel), with the ratio VNNI / ours.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    from quantkit.kernels.cpu_int import best_ms
    from quantkit.kernels.cpu_linear import PrepackedLinear, prepack_supported
    from quantkit.kernels.int4_cpu import extension
    from quantkit.kernels.int8_cpu import Int8Linear, int8_kernel_available, quantize_int8

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="32000x1024")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not int8_kernel_available() or not prepack_supported(torch.bfloat16):
        raise SystemExit("needs a CPU with AVX-512 BF16 (the int8 kernel and oneDNN's native bf16)")
    n, k = map(int, args.shape.split("x"))
    linear = torch.nn.Linear(k, n, bias=False).requires_grad_(False)
    linear.weight.data = 0.02 * torch.randn(n, k)
    ours = Int8Linear.from_linear(linear)
    q, s = quantize_int8(linear.weight, k)  # torch's op takes one scale per row
    s16 = s.squeeze(1).bfloat16()
    linear.weight.data = linear.weight.bfloat16()
    dense = PrepackedLinear(linear)
    print(f"[{n} x {k}], bf16 activations, {args.threads} threads, best of {args.reps} calls and {args.rounds} "
          f"rounds (ms); load average {os.getloadavg()[0]:.2f}")
    ext = extension()
    amx = ext.has_amx()

    def vnni(x):  # the head with its AMX path off
        old = ext.set_amx(False)
        try:
            return ours(x)
        finally:
            ext.set_amx(old)

    print(f"{'M':>3} {'int8 (ours)':>11} {'bf16 prepacked':>14} {'torch int8pack':>14} {'bf16/ours':>9} "
          f"{'torch/ours':>10}" + (f" {'int8 VNNI':>9} {'VNNI/ours':>9}" if amx else ""))
    with torch.inference_mode():
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k).bfloat16()
            calls = [lambda: ours(x), lambda: dense(x), lambda: torch._weight_int8pack_mm(x, q, s16)]
            if amx:
                calls.append(lambda: vnni(x))
            best = [min(r) for r in zip(*[[best_ms(f, args.reps) for f in calls] for _ in range(args.rounds)])]
            print(f"{m:>3} {best[0]:>11.3f} {best[1]:>14.3f} {best[2]:>14.3f} {best[1] / best[0]:>9.2f} "
                  f"{best[2] / best[0]:>10.2f}" + (f" {best[3]:>9.3f} {best[3] / best[0]:>9.2f}" if amx else ""),
                  flush=True)


if __name__ == "__main__":
    main()
