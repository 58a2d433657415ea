"""GPTQ's Hessian accumulation (quantkit.quant.gptq.accumulate_hessian: the lower triangle in 8 column blocks,
mirrored block by block) against the previous one (4 column blocks, mirrored through three K x K temporaries), one
process, alternating rounds, on an 8B model's shapes.

  python benchmarks/gptq_hessian.py [--k 4096,14336] [--tokens 4096] [--batches 2] [--rounds 3] [--threads 2]

Each side folds --batches bf16 batches of --tokens random tokens into one H, as a decoder layer's calibration
batches are. Prints each side's median seconds, the median of the per-round ratios (previous / ours: above 1 is
faster), and whether the two H are equal bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.bench.rounds import alternate, per_round


def previous_accumulate(h: torch.Tensor, n: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """accumulate_hessian as it was: 4 column blocks, then lower + lower.tril(-1).T."""
    x = x.reshape(-1, x.shape[-1]).to(h.dtype)
    m, k = x.shape
    step = -(-k // 4)
    for i in range(0, k, step):
        h[i:, i:i + step].addmm_(x[:, i:].T, x[:, i:i + step], beta=n / (n + m), alpha=2.0 / (n + m))
    lower = h.tril()
    h.copy_(lower + lower.tril(-1).T)
    return h, n + m


def fold(accumulate, batches: list[torch.Tensor]) -> torch.Tensor:
    from quantkit.quant.gptq import empty_hessian

    h, n = empty_hessian(batches[0].shape[-1]), 0
    for x in batches:
        h, n = accumulate(h, n, x)
    return h


def bench(k: int, tokens: int, n_batches: int, rounds: int) -> None:
    from quantkit.quant.gptq import accumulate_hessian

    g = torch.Generator().manual_seed(k)
    batches = [torch.randn(tokens, k, generator=g).bfloat16() for _ in range(n_batches)]
    got: dict[str, torch.Tensor] = {}

    def timed(name: str, accumulate) -> float:
        start = time.perf_counter()
        got[name] = fold(accumulate, batches)
        return time.perf_counter() - start

    times = alternate({"previous": lambda: timed("previous", previous_accumulate),
                       "ours": lambda: timed("ours", accumulate_hessian)}, rounds)
    print(f"K={k}, {n_batches} x {tokens} tokens: previous {statistics.median(times['previous']):.2f} s, "
          f"ours {statistics.median(times['ours']):.2f} s, previous/ours {per_round(times['previous'], times['ours'])} "
          f"({rounds} rounds); bit-identical: {torch.equal(got['previous'], got['ours'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="4096,14336", help="comma-separated K (H is K x K)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for k in (int(v) for v in args.k.split(",")):
        bench(k, args.tokens, args.batches, args.rounds)


if __name__ == "__main__":
    main()
