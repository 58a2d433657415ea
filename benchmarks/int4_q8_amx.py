"""The W4A8 kernel on AMX-INT8 tiles (kernels/csrc/int4_q8_amx.h) against the same kernel on vpdpbusd
(int4_q8_avx512.h) and against W4A16 (int4_linear_bf16: AMX bf16 tiles from 2 rows), over a decode step's int4
linears at Llama-3.2-1B's shape: 16 layers of q|k|v 3072 x 2048, o 2048 x 2048, gate|up 16384 x 2048 and down
2048 x 8192 (random codes, group 128; 486 MB of codes, more than the caches hold), bf16 activations, one process.

Each round times the three in a rotated order at every M (the host's bandwidth drifts within a minute); the table
gives the median of the rounds and the medians of the per-round ratios. Needs the `amx` level (AMX granted).

    python benchmarks/int4_q8_amx.py --ms 1,2,4,8,16,32,64,128 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from quantkit.bench.rounds import alternate, median_row, rotated_order, table_head

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # q|k|v, o, gate|up, down at the 1B shape
GROUP = 128


Weights = list[tuple[torch.Tensor, torch.Tensor, int, int]]


def weights(layers: int, shapes: tuple[tuple[int, int], ...] = SHAPES) -> Weights:
    """(packed, scale_zero, N, K) for `layers` copies of the linears of `shapes` (N, K): random codes, fp16 scales,
    zero 8."""
    from quantkit.kernels.int4_cpu import pack_blocks

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        for n, k in shapes:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            scales = (torch.rand(k // GROUP, n, generator=gen) * 0.01 + 1e-3).half().float()
            out.append((*pack_blocks(codes, scales, torch.full((k // GROUP, n), 8.0), GROUP), n, k))
    return out


def passes(ext, ws, m: int) -> dict[str, Callable[[], None]]:
    """name -> one pass over every linear at m rows."""
    xs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

    def over(op, amx_from_m: int | None = None) -> Callable[[], None]:
        def run() -> None:
            if amx_from_m is not None:
                ext.dev.set_int4_q8_amx_from_m(amx_from_m)
            for packed, sz, n, k in ws:
                op(xs[k], packed, sz, n, GROUP, True)
        return run

    return {"W4A16": over(ext.int4_linear_bf16), "W4A8 vpdpbusd": over(ext.int4_linear_q8, 1 << 30),
            "W4A8 AMX": over(ext.int4_linear_q8, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="passes a round; the best counts")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from quantkit.kernels.cpu_int import best_ms
    from quantkit.kernels.int4_cpu import extension

    torch.set_num_threads(args.threads)
    ext = extension()
    if ext is None or not hasattr(ext.dev, "set_int4_q8_amx_from_m") or not ext.has_amx():
        raise SystemExit("needs the amx level with AMX granted (quantkit env)")
    old = ext.dev.set_int4_q8_amx_from_m(1)
    ws = weights(args.layers)
    print(f"{args.layers} layers of {', '.join(f'{n}x{k}' for n, k in SHAPES)}, group {GROUP}, {args.threads} threads, "
          f"median of {args.rounds} rounds (best of {args.reps} passes each)")
    print(table_head(("M", "W4A16 ms", "W4A8 vpdpbusd ms", "W4A8 AMX ms", "AMX / W4A16", "AMX / vpdpbusd")))
    try:
        for m in (int(v) for v in args.ms.split(",")):
            timed = {name: (lambda run=run: best_ms(run, args.reps)) for name, run in passes(ext, ws, m).items()}
            times = alternate(timed, args.rounds, order=rotated_order)
            print(median_row(m, times, (("W4A16", "W4A8 AMX"), ("W4A8 vpdpbusd", "W4A8 AMX"))), flush=True)
    finally:
        ext.dev.set_int4_q8_amx_from_m(old)


if __name__ == "__main__":
    main()
