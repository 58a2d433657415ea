"""GPTQ's factor of the inverse Hessian (upper U, U^T U = (H + damp)^-1, float64): quantkit's one Cholesky of the
reversed H and a triangular inverse (quantkit.quant.gptq.inverse_hessian_cholesky, ~2/3 K^3 flops) against the
chain that llm-compressor, GPTQModel and quantkit until now compute (cholesky, cholesky_inverse, cholesky upper:
~4/3 K^3), one process, alternating rounds.

  python benchmarks/gptq_factor.py [--k 4096,14336] [--tokens 8192] [--rounds 3] [--threads 2] [--thread-check]

H = 2 X^T X / T from T random tokens with a shared low-rank part and uneven channel scales (T < K leaves H singular,
as an 8B model's down_proj is with 16 x 512 windows: the 1% damping makes it definite). Prints each side's median
seconds, the median of the per-round ratios (chain / ours: above 1 is faster), and how far U is from the chain's
(entries that differ after rounding to fp32, the largest difference). With --thread-check, ours runs again at 1
thread and at --threads, and the two fp32 factors must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.bench.rounds import alternate, per_round


def hessian(k: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """H [K, K] fp32 as GPTQ accumulates it, from tokens x K inputs: a rank-64 shared part plus noise, channel
    scales spread over two decades."""
    from quantkit.quant.gptq import accumulate_hessian, empty_hessian

    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]
    x = (torch.randn(tokens, 64, generator=g) @ torch.randn(64, k, generator=g) * 0.1
         + torch.randn(tokens, k, generator=g)) * scales
    return accumulate_hessian(empty_hessian(k), 0, x)[0]


def chain_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The three-step chain in one float64 buffer, in place (as quantkit did it before), rounded to fp32."""
    a = h.to(torch.float64, copy=True).mT
    a.diagonal().add_(damp * h.diagonal().double().mean())
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(a, out=(a, info))
    torch.cholesky_inverse(a, out=a)
    torch.linalg.cholesky_ex(a, upper=True, out=(a, info))
    return a.float()


def timed(fn, out: dict, key: str) -> float:
    start = time.perf_counter()
    out[key] = fn()
    return time.perf_counter() - start


def bench(k: int, tokens: int, rounds: int, thread_check: bool, threads: int) -> None:
    from quantkit.quant.gptq import inverse_hessian_cholesky

    h = hessian(k, tokens)
    got: dict[str, torch.Tensor] = {}
    times = alternate({"chain": lambda: timed(lambda: chain_factor(h, 0.01), got, "chain"),
                       "ours": lambda: timed(lambda: inverse_hessian_cholesky(h, 0.01, 0)[0], got, "ours")}, rounds)
    same = float((got["ours"] == got["chain"]).double().mean())
    diff = float((got["ours"] - got["chain"]).abs().max() / got["chain"].abs().max())
    print(f"K={k}: chain {statistics.median(times['chain']):.2f} s, ours {statistics.median(times['ours']):.2f} s, "
          f"chain/ours {per_round(times['chain'], times['ours'])} ({rounds} rounds); "
          f"fp32 entries equal to the chain's {same:.6f}, largest difference {diff:.1e} of max|U|")
    if thread_check:
        factors = []
        for n in (1, threads):
            torch.set_num_threads(n)
            factors.append(inverse_hessian_cholesky(h, 0.01, 0)[0])
        torch.set_num_threads(threads)
        print(f"K={k}: ours at 1 and {threads} threads bit-identical: {torch.equal(factors[0], factors[1])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="4096,14336", help="comma-separated K (H is K x K)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--thread-check", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for k in (int(v) for v in args.k.split(",")):
        bench(k, args.tokens, args.rounds, args.thread_check, args.threads)


if __name__ == "__main__":
    main()
