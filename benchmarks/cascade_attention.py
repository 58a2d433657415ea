"""Attention of workload (b)'s steps, per layer: per-sequence paged attention against cascade
(shared-prefix) attention, same inputs, one after the other.

  python benchmarks/cascade_attention.py [--threads 2] [--sequences 32] [--prefix 512] [--repeats 20]
      [--dtype float32|bfloat16] [--sweep-widen 1,2,4,8]

Shapes of the vLLM comparison's model (16 heads, 8 KV heads, head_dim 64, block 16): every
sequence starts with the same `prefix` tokens' blocks. Two steps: a decode (one query per sequence,
32 own tokens cached past the prefix) and a prefill after a prefix hit (the 32 own prompt tokens of
every sequence over the cached prefix). Prints ms per layer call (median of --repeats) and the ratio,
for both paths of the AVX-512 block step (each row over a block on its own, or the block widened once
for all the rows of a work item; `set_widen_from_rows`), with the AMX step off, and, on a bf16 cache where
the AMX step is built and granted, with it on (attention_amx.h: from its default rows), in one process, and
each path's largest and mean absolute error against the fp32 torch reference on the same (dtype-rounded) inputs.
--sweep-widen also times plain paged attention (no shared prefix) on 64 sequences of 200 cached tokens,
a decode step and a step of 16-token chunks, at each of the given thresholds (rows of a work item
from which a block is widened; "never" added) to check the default.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.engine.shared_prefix import plan_shared_prefix
from quantkit.kernels.paged_attention_cpu import cpu_attention, paged_attention_cpu
from quantkit.kernels.paged_attention_reference import paged_prefill_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16


def step_inputs(n_seqs: int, prefix: int, own: int, chunk: int, dtype: torch.dtype, seed: int = 0):
    """Caches and metadata of one step: n_seqs sequences of prefix + own tokens, the last `chunk` new."""
    g = torch.Generator().manual_seed(seed)
    shared, per_seq = prefix // BLOCK, -(-(prefix + own) // BLOCK) - prefix // BLOCK
    kc = torch.randn(shared + n_seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    vc = torch.randn(kc.shape, generator=g).to(dtype)
    block_ids = [list(range(shared)) + list(range(shared + i * per_seq, shared + (i + 1) * per_seq))
                 for i in range(n_seqs)]
    seq_lens, chunks = [prefix + own] * n_seqs, [chunk] * n_seqs
    q = torch.randn(n_seqs * chunk, HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = torch.tensor(block_ids, dtype=torch.int32)
    starts = torch.tensor([i * chunk for i in range(n_seqs + 1)], dtype=torch.int32)
    plan = plan_shared_prefix(seq_lens, chunks, tables, BLOCK)
    return (q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), starts, HEAD_DIM ** -0.5), plan


def reference(q, kc, vc, tables, seq_lens, starts, scale) -> torch.Tensor:
    """The torch reference per sequence, in fp32 on the same inputs."""
    q, kc, vc = q.float(), kc.float(), vc.float()
    return torch.cat([paged_prefill_attention_reference(q[starts[i]:starts[i + 1]], kc, vc, tables[i], int(n), scale)
                      for i, n in enumerate(seq_lens.tolist())])


def errors(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.float() - want).abs()
    return f"{diff.max():.4f} / {diff.mean():.5f}"


def sweep(mod, thresholds: list[int], dtype: torch.dtype, repeats: int) -> None:
    print("\nPlain paged attention, 64 sequences of 200 cached tokens, ms per layer call by the rows from which "
          "a block is widened:")
    print("| step | " + " | ".join(str(t) for t in thresholds) + " | never |\n|---|" + "---|" * (len(thresholds) + 1))
    for name, own, chunk in (("64 decodes", 200, 1), ("64 chunks of 16", 200, 16)):
        inputs, _ = step_inputs(64, 0, own, chunk, dtype)
        cells = []
        for rows in [*thresholds, 1 << 40]:
            mod.dev.set_widen_from_rows(rows)
            cells.append(f"{median_ms(lambda: paged_attention_cpu(*inputs), repeats):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--own", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--sweep-widen", help="comma-separated thresholds to time plain paged attention at")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mod = cpu_attention()
    if mod is None:
        raise SystemExit("the C++ attention extension is unavailable (see the log line above)")
    default = mod.dev.set_widen_from_rows(1)
    if default < 0:
        raise SystemExit("this build has no AVX-512 block step: nothing to compare")
    # path: (rows from which a block is widened, AMX step on); the AVX-512 paths with AMX off
    paths = {"per-row": (1 << 40, False), "widened": (default, False)}
    if mod.has_amx() and dtype == torch.bfloat16:
        paths["AMX"] = (default, True)
    print(f"{args.sequences} sequences on a {args.prefix}-token prefix + {args.own} own, {args.threads} threads, "
          f"{args.dtype}, ms per layer call (median of {args.repeats}); widened from {default} rows"
          + ("; AMX: the AMX step from its default rows, the AVX-512 ones below them" if "AMX" in paths else ""))
    last = list(paths)[-1]
    print("| step | " + " | ".join(f"{kind}, {path}" for kind in ("per-sequence", "cascade") for path in paths)
          + f" | per-row / {last} (cascade) | " + " | ".join(f"max / mean error, {path}" for path in paths) + " |")
    print("|---|" + "---|" * (3 * len(paths) + 1))
    old_amx = mod.dev.set_amx(False)
    try:
        for name, chunk in (("decode", 1), (f"prefill of {args.own} after a prefix hit", args.own)):
            own = args.own + (1 if chunk == 1 else 0)
            inputs, plan = step_inputs(args.sequences, args.prefix, own, chunk, dtype)
            want = reference(*inputs)
            ms, err = {}, {}
            for path, (rows, amx) in paths.items():
                mod.dev.set_widen_from_rows(rows)
                mod.dev.set_amx(amx)
                ms["plain", path] = median_ms(lambda: paged_attention_cpu(*inputs), args.repeats)
                ms["cascade", path] = median_ms(lambda: paged_attention_cpu(*inputs, plan), args.repeats)
                err[path] = errors(paged_attention_cpu(*inputs, plan), want)
            cells = " | ".join(f"{ms[kind, path]:.2f}" for kind in ("plain", "cascade") for path in paths)
            print(f"| {name} | {cells} | {ms['cascade', 'per-row'] / ms['cascade', last]:.2f}x faster | "
                  + " | ".join(err[path] for path in paths) + " |")
        mod.dev.set_amx(old_amx)
        if args.sweep_widen:
            sweep(mod, [int(t) for t in args.sweep_widen.split(",")], dtype, args.repeats)
    finally:
        mod.dev.set_widen_from_rows(default)
        mod.dev.set_amx(old_amx)

if __name__ == "__main__":
    main()
