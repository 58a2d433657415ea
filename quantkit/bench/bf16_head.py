"""An unquantized lm_head on a CPU without native bf16: quantkit's bf16-weight kernel (kernels/bf16_cpu.py,
weight widened to fp32 on the fly) against fp32 F.linear and oneDNN's prepacked fp32 linear, one process.

  python -m quantkit.bench.bf16_head [--threads 2] [--shape 32000x1024] [--ms 1,2,8,16,32,64,128] [--reps 20]

Shape is N x K (vocab x hidden). Times are the best of --reps calls, in ms; the ratio is fp32 F.linear / bf16.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    from quantkit.kernels.bf16_cpu import Bf16Linear, unavailable
    from quantkit.kernels.cpu_int import best_ms
    from quantkit.kernels.cpu_linear import PrepackedLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="32000x1024")
    ap.add_argument("--ms", default="1,2,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if (why := unavailable()) is not None:
        raise SystemExit(f"the bf16 CPU kernel is unavailable: {why}")
    n, k = map(int, args.shape.split("x"))
    w16 = torch.randn(n, k).bfloat16()
    w32 = w16.float()
    head = Bf16Linear(w16)  # packed once, as the engine holds it
    pre = PrepackedLinear(torch.nn.Linear(k, n, bias=False).requires_grad_(False))
    pre.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w32, None)
    print(f"[{n} x {k}], {args.threads} threads, best of {args.reps} (ms); load average {os.getloadavg()[0]:.2f}")
    print(f"{'M':>3} {'bf16 kernel':>11} {'fp32 F.linear':>13} {'fp32 prepacked':>14} {'F.linear/bf16':>13}")
    with torch.inference_mode():
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k)
            b = best_ms(lambda: head(x), args.reps)
            f = best_ms(lambda: torch.nn.functional.linear(x, w32), args.reps)
            p = best_ms(lambda: pre(x), args.reps)
            print(f"{m:>3} {b:>11.3f} {f:>13.3f} {p:>14.3f} {f / b:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
