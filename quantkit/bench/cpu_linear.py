"""CPU linear paths side by side, one process: F.linear, oneDNN-prepacked, torch's int4 kernel,
int4 dequantized per call; and the int4 kernel/dequantize crossover the engine would pick.

  python -m quantkit.bench.cpu_linear [--threads 2] [--n 2816] [--k 1024] [--group-size 128]
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize
    from quantkit.kernels.cpu_int import best_ms, int4_kernel_max_m, int4_linear, repack_int4
    from quantkit.kernels.cpu_linear import PrepackedLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2816)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--ms", default="1,8,64,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    linear = torch.nn.Linear(args.k, args.n, bias=False)
    prepacked = PrepackedLinear(linear)
    w4 = repack_int4(pack(rtn_quantize(linear.weight.detach(), QuantScheme(4, args.group_size, True)), "gptq"),
                     torch.float32)
    print(f"[{args.n} x {args.k}] fp32, {args.threads} threads, best of 3 (ms); load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'M':>5} {'F.linear':>9} {'prepacked':>9} {'int4 kernel':>11} {'int4 dequant':>12}")
    with torch.inference_mode():
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, args.k)
            row = [best_ms(lambda: linear(x)), best_ms(lambda: prepacked(x)),
                   best_ms(lambda: int4_linear(x, w4, None, kernel_max_m=m)),
                   best_ms(lambda: int4_linear(x, w4, None, kernel_max_m=0))]
            print(f"{m:>5} " + " ".join(f"{v:>9.3f}  " for v in row), flush=True)
        print(f"int4 kernel used up to M = {int4_kernel_max_m(args.n, args.k, args.group_size, torch.float32)}")


if __name__ == "__main__":
    main()
