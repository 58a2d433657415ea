"""Decode attention over a KV cache read from memory: the C++ paged attention of one decode step of every
layer, with 0 to 4 cache blocks prefetched ahead of the one being folded (`set_prefetch_blocks`), one process.

  python benchmarks/decode_attention.py [--threads 2] [--batches 1,8,32] [--keys 192] [--rounds 20]

Shapes of the vLLM comparison's model (8 layers, 16 heads, 8 KV heads, head_dim 64, bf16 cache, block 16).
Each layer has its own cache, in a pool 4x the blocks in use, each sequence's blocks at random places in it
(as the engine's pool hands them out), so a step reads its 8 layers' keys and values from memory, not from
the cache of the call before. Rounds alternate the settings (in reverse every other round); per setting: the median
and best ms of a step (the 8 layers' calls), and the median of each round's ratio to no prefetch. The outputs of
every setting are checked to be bit-equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from quantkit.bench.rounds import alternate
from quantkit.kernels.paged_attention_cpu import cpu_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 16, 8, 64, 16
AHEAD = (0, 1, 2, 3, 4)


def step_inputs(batch: int, keys: int, seed: int = 0, layers: int = LAYERS, heads: int = HEADS):
    """(caches per layer, block tables, seq_lens, query_start, q) of a decode step of `batch` sequences, `layers`
    layers of `heads` query heads (KV_HEADS kv heads of HEAD_DIM, blocks of BLOCK tokens)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-keys // BLOCK)
    pool = 4 * batch * per_seq
    caches = [tuple(torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
              for _ in range(layers)]
    tables = torch.randperm(pool, generator=g)[:batch * per_seq].int().view(batch, per_seq)
    lens = torch.full((batch,), keys, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, heads, HEAD_DIM, generator=g).bfloat16()
    return caches, tables, lens, starts, q


def timed_step(mod, step: Callable[[], list[torch.Tensor]], ahead: int,
               outs: dict[int, list[torch.Tensor]]) -> Callable[[], float]:
    """One timed run of `step` with `ahead` blocks prefetched: its ms, its outputs left in outs[ahead]."""
    def run() -> float:
        mod.dev.set_prefetch_blocks(ahead)
        step()  # the previous setting's step left other blocks in the cache than this one reads
        t = time.perf_counter()
        outs[ahead] = step()
        return (time.perf_counter() - t) * 1e3
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--keys", type=int, default=192, help="cached tokens per sequence")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = cpu_attention()
    if mod is None:
        raise SystemExit("the C++ attention is not built on this machine")
    batches = [int(b) for b in args.batches.split(",")]
    none_i32, none_f32 = torch.empty(0, dtype=torch.int32), torch.empty(0)
    default = mod.dev.set_prefetch_blocks(0)
    print(f"{args.threads} threads, {args.keys} cached tokens a sequence, {LAYERS} layers a step; default: "
          f"{default} blocks ahead")
    try:
        for batch in batches:
            caches, tables, lens, starts, q = step_inputs(batch, args.keys)

            def step():
                return [mod.paged_attention(q, k, v, tables, lens, starts, HEAD_DIM ** -0.5, none_i32, none_f32,
                                            none_f32, none_f32) for k, v in caches]

            outs: dict[int, list[torch.Tensor]] = {}
            ms = alternate({a: timed_step(mod, step, a, outs) for a in AHEAD}, args.rounds)
            if not all(torch.equal(x, y) for a in AHEAD for x, y in zip(outs[0], outs[a])):
                raise SystemExit("prefetching changed the output")
            for a in AHEAD:
                ratio = statistics.median(n / t for n, t in zip(ms[0], ms[a]))
                print(f"batch {batch:>3}, {a} blocks ahead: {statistics.median(ms[a]):.3f} ms (best "
                      f"{min(ms[a]):.3f}), none / this per round {ratio:.2f}x", flush=True)
    finally:
        mod.dev.set_prefetch_blocks(default)


if __name__ == "__main__":
    main()
