"""Decode attention over a KV cache in 4 KiB pages against the same cache in transparent huge pages (what the engine
allocates with `cpu_huge_pages`, engine/model_runner.kv_tensors): the C++ paged attention of one decode step of every
layer, the blocks scattered over a pool 4x their number (decode_attention.step_inputs), one process, the order
flipped each round, each timed step after the other variant's (so its blocks come from memory). The outputs of both
are checked to be bit-equal.

    python benchmarks/kv_huge_pages.py --batches 1,8,32 --keys 256 --rounds 10

Shapes: the Llama-3.2-1B shape's attention (16 layers, 32 heads, 8 KV heads, head_dim 64, bf16 cache, block 16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import decode_attention
from quantkit.bench.rounds import alternate

LAYERS, HEADS = 16, 32  # the 1B shape's; its kv heads, head_dim and block are decode_attention's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--keys", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    from quantkit.engine.huge_pages import thp_unavailable, zeros_in_huge_pages
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    if (why := thp_unavailable()) is not None:
        raise SystemExit(why)
    torch.set_num_threads(args.threads)
    mod = cpu_attention()
    if mod is None:
        raise SystemExit("the C++ attention is not built on this machine")
    none_i32, none_f32 = torch.empty(0, dtype=torch.int32), torch.empty(0)
    print(f"{args.threads} threads, {args.keys} cached tokens a sequence, {LAYERS} layers a step")
    for batch in (int(b) for b in args.batches.split(",")):
        caches, tables, lens, starts, q = decode_attention.step_inputs(batch, args.keys, layers=LAYERS, heads=HEADS)
        huge = zeros_in_huge_pages(caches[0][0].shape, caches[0][0].dtype, 2 * len(caches))
        for t, c in zip(huge, (c for kv in caches for c in kv)):
            t.copy_(c)
        variants = {"4 KiB": caches, "huge": list(zip(huge[::2], huge[1::2]))}
        outs = {}

        def timed(name: str):
            other = variants["huge" if name == "4 KiB" else "4 KiB"]

            def run() -> float:
                step(other)  # the other variant's blocks now in the caches, not this one's
                t = time.perf_counter()
                outs[name] = step(variants[name])
                return (time.perf_counter() - t) * 1e3
            return run

        def step(kv):
            scale = decode_attention.HEAD_DIM ** -0.5
            return [mod.paged_attention(q, k, v, tables, lens, starts, scale, none_i32, none_f32, none_f32, none_f32)
                    for k, v in kv]

        ms = alternate({name: timed(name) for name in variants}, args.rounds)
        if not all(torch.equal(a, b) for a, b in zip(outs["4 KiB"], outs["huge"])):
            raise SystemExit("the pages changed the output")
        gb = LAYERS * batch * args.keys * 2 * caches[0][0][0, 0].numel() * 2 / 1e9
        med = {name: statistics.median(t) for name, t in ms.items()}
        ratio = statistics.median(a / b for a, b in zip(ms["4 KiB"], ms["huge"]))
        print(f"batch {batch:>3}: 4 KiB pages {med['4 KiB']:.2f} ms ({gb / med['4 KiB'] * 1e3:.1f} GB/s), huge pages "
              f"{med['huge']:.2f} ms ({gb / med['huge'] * 1e3:.1f} GB/s), 4 KiB / huge per round {ratio:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
