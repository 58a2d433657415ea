"""Where prefill chunks should go dense on AMX: one layer's four int4 linears at a real shape (Llama-3.2-1B's or
Llama-3.1-8B's), through W4A8 on AMX-INT8 tiles (int4_linear_q8), W4A16 on AMX bf16 tiles (int4_linear_bf16) and the
dense path (`int4_blocked_linear` from M = 0: tiles dequantized into the bf16 kernel's layout and multiplied on
AMX), per M, rounds in alternating order, one process. The crossovers set int4_cpu.DENSE_FROM_M_AMX and
DENSE_FROM_M_Q8_AMX.

    python benchmarks/amx_dense_crossover.py --shape 1b --ms 256,512,768,1024,1536,2048 --rounds 4 --threads 2
"""

from __future__ import annotations

import argparse

import torch

from int4_q8_amx import GROUP, weights  # the 1B shape's random layer (group 128, fp16 scales, zero 8)
from quantkit.bench.rounds import alternate, median_row, table_head

SHAPES = {"1b": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)),
          "8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}  # q|k|v, o, gate|up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--ms", default="256,512,768,1024,1536,2048")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="passes a round; the best counts")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from quantkit.kernels import int4_cpu
    from quantkit.kernels.cpu_int import best_ms

    torch.set_num_threads(args.threads)
    ext = int4_cpu.extension()
    if ext is None or not hasattr(ext, "int4_q8_amx_takes") or not ext.int4_q8_amx_takes(GROUP):
        raise SystemExit("needs the amx level with AMX granted (quantkit env)")
    ws = weights(1, SHAPES[args.shape])
    blocked = [int4_cpu.Int4Blocked(packed, sz, n, GROUP, None) for packed, sz, n, _ in ws]
    old = ext.dev.set_int4_q8_amx_from_m(1)
    print(f"one layer of the {args.shape} shape ({', '.join(f'{n}x{k}' for n, k in SHAPES[args.shape])}), group "
          f"{GROUP}, {args.threads} threads, median of {args.rounds} rounds (best of {args.reps} passes each)")
    print(table_head(("M", "W4A8 AMX-INT8 ms", "W4A16 AMX ms", "dense ms", "dense / W4A8", "dense / W4A16")))
    try:
        for m in (int(v) for v in args.ms.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES[args.shape]}
            runs = {"q8": lambda: [ext.int4_linear_q8(xs[k], p, sz, n, GROUP, True) for p, sz, n, k in ws],
                    "w16": lambda: [ext.int4_linear_bf16(xs[k], p, sz, n, GROUP, True) for p, sz, n, k in ws],
                    "dense": lambda: [int4_cpu.int4_blocked_linear(xs[k], w, None, dense_from_m=0)
                                      for w, (_, _, _, k) in zip(blocked, ws)]}
            times = alternate({name: (lambda run=run: best_ms(run, args.reps)) for name, run in runs.items()},
                              args.rounds)
            print(median_row(m, times, (("dense", "q8"), ("dense", "w16")), digits=1), flush=True)
    finally:
        ext.dev.set_int4_q8_amx_from_m(old)


if __name__ == "__main__":
    main()
