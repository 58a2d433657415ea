"""A decode step's bookkeeping (scheduling and the attention metadata, no model) as sequences grow, one process.

  python benchmarks/step_bookkeeping.py [--batch 64] [--lengths 256,2000] [--shared 0,1600]
                                            [--rounds 7] [--steps 40] [--threads 2]

For each context length L (and each shared prefix length S < L): `--batch` requests of L prompt tokens, the first S
the same for all (prefix-cache hits), are prefilled, then decode. A round times `--steps` decode steps of
Scheduler.schedule, build_metadata and the scheduler's update, two ways, alternating:
- kept: the block table the KV cache manager keeps (one gather a step; the engine's path);
- lists: the same table built from the chunks' block-id lists each step (build_metadata without `table`).
The bookkeeping of a step should not grow with L: the last column is each length's time over the shortest's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

BLOCK = 16


@dataclass
class Case:
    batch: int
    length: int
    shared: int


def make_scheduler(case: Case):
    from quantkit.engine.kv_cache_manager import KVCacheManager
    from quantkit.engine.request import Request
    from quantkit.engine.sampling_params import SamplingParams
    from quantkit.engine.scheduler import Scheduler

    blocks = case.batch * (case.length // BLOCK + 64) + 64
    s = Scheduler(KVCacheManager(blocks, BLOCK), max_num_seqs=case.batch,
                  max_num_batched_tokens=case.batch * case.length + case.batch)
    prefix = list(range(1, case.shared + 1))
    params = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
    for i in range(case.batch):
        own = [(i * 7919 + j) % 30000 + 1 for j in range(case.length - case.shared)]
        s.add_request(Request(str(i), prefix + own, params, BLOCK))
    return s


def step(s, kept: bool) -> None:
    from quantkit.engine.attention import build_metadata

    out = s.schedule()
    chunks = out.chunks
    build_metadata([c.start + c.num_tokens for c in chunks], [c.num_tokens for c in chunks],
                   [c.block_ids for c in chunks], BLOCK, torch.device("cpu"), torch.bfloat16,
                   out.block_table if kept else None)
    s.update_from_output(out)
    for c in chunks:
        if c.samples:
            c.request.append_token(7, 0.0)


def measure(case: Case, rounds: int, steps: int) -> dict[str, float]:
    """Median ms a step of each way over `rounds` alternating rounds."""
    s = make_scheduler(case)
    for _ in range(3):
        step(s, kept=True)  # the prefill, then decodes
    times: dict[str, list[float]] = {"kept": [], "lists": []}
    for _ in range(rounds):
        for way in times:
            t = time.perf_counter()
            for _ in range(steps):
                step(s, kept=way == "kept")
            times[way].append((time.perf_counter() - t) / steps * 1e3)
    return {way: statistics.median(v) for way, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", default="256,2000")
    ap.add_argument("--shared", default="0,1600", help="shared prefix lengths (those below a length run with it)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    shared = [int(x) for x in args.shared.split(",")]
    print(f"batch {args.batch}, block {BLOCK}, median of {args.rounds} alternating rounds of {args.steps} steps")
    print("length | shared | kept table ms/step | lists ms/step | lists / kept | kept / shortest's kept")
    for sh in shared:
        first = None
        for length in (n for n in lengths if n > sh):
            r = measure(Case(args.batch, length, sh), args.rounds, args.steps)
            first = first or r["kept"]
            print(f"{length} | {sh} | {r['kept']:.3f} | {r['lists']:.3f} | {r['lists'] / r['kept']:.2f}x | "
                  f"{r['kept'] / first:.2f}x", flush=True)


if __name__ == "__main__":
    main()
