"""GPTQ's two largest math steps at an 8B model's shapes, each against its previous form, one process, alternating
rounds (ours and the previous in turn, printing the median per-round ratio, previous / ours: above 1 is faster).

  python benchmarks/gptq_steps.py [--steps factor,factor-fp32,hessian] [--k 4096,14336] [--rounds 3] [--threads 2]
                                  [--tokens 8192] [--thread-check]

factor: the float64 factor of the inverse Hessian (upper U, U^T U = (H + damp)^-1), quantkit's one Cholesky of the
reversed H and a triangular inverse (quantkit.quant.gptq.inverse_hessian_cholesky, ~2/3 K^3 flops) against the chain
that llm-compressor, GPTQModel and quantkit until now compute (cholesky, cholesky_inverse, cholesky upper: ~4/3 K^3).
H = 2 X^T X / T from --tokens random tokens with a shared low-rank part and uneven channel scales (T < K leaves H
singular, as an 8B model's down_proj is with 16 x 512 windows: the 1% damping makes it definite). Also prints how far
U is from the chain's; with --thread-check, ours runs again at 1 thread and at --threads, and says whether the two
fp32 factors are equal bit for bit.

factor-fp32: the same factor worked in fp32 (GPTQOptions.factor_dtype, as llm-compressor and GPTQModel factor)
against float64: time, how far the fp32 U are apart, and with --thread-check whether the fp32 one depends on the
thread count.

hessian: the Hessian accumulation (accumulate_hessian: the lower triangle in 8 column blocks, mirrored block by
block) against the previous one (4 column blocks, mirrored through three K x K temporaries), folding two bf16
batches of --tokens / 2 random tokens into one H as a decoder layer's calibration batches are; says whether the
two H are equal bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.bench.rounds import add_round_options, alternate, per_round


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


def timed(fn, out: dict, key: str) -> float:
    start = time.perf_counter()
    out[key] = fn()
    return time.perf_counter() - start


def report(step: str, k: int, times: dict[str, list[float]], base: str, rounds: int) -> str:
    return (f"{step} K={k}: {base} {statistics.median(times[base]):.2f} s, ours {statistics.median(times['ours']):.2f} s, "
            f"{base}/ours {per_round(times[base], times['ours'])} ({rounds} rounds)")


def bench_factor(k: int, tokens: int, rounds: int, thread_check: bool, threads: int) -> None:
    from quantkit.quant.gptq import inverse_hessian_cholesky

    h = hessian(k, tokens)
    got: dict[str, torch.Tensor] = {}
    times = alternate({"chain": lambda: timed(lambda: chain_factor(h, 0.01), got, "chain"),
                       "ours": lambda: timed(lambda: inverse_hessian_cholesky(h, 0.01, 0)[0], got, "ours")}, rounds)
    same = float((got["ours"] == got["chain"]).double().mean())
    diff = float((got["ours"] - got["chain"]).abs().max() / got["chain"].abs().max())
    print(f"{report('factor', k, times, 'chain', rounds)}; fp32 entries equal to the chain's {same:.6f}, "
          f"largest difference {diff:.1e} of max|U|")
    if thread_check:
        print(f"factor K={k}: ours at 1 and {threads} threads: {threads_differ(h, threads)} of {k * k} fp32 "
              f"entries differ")


def threads_differ(h: torch.Tensor, threads: int, dtype: torch.dtype = torch.float64) -> int:
    """How many entries of the fp32 factor of H (worked in `dtype`) differ between 1 and `threads` threads."""
    from quantkit.quant.gptq import inverse_hessian_cholesky

    factors = []
    for n in (1, threads):
        torch.set_num_threads(n)
        factors.append(inverse_hessian_cholesky(h, 0.01, 0, dtype=dtype)[0])
    torch.set_num_threads(threads)
    return int((factors[0] != factors[1]).sum())


def bench_factor_fp32(k: int, tokens: int, rounds: int, thread_check: bool, threads: int) -> None:
    """The factor worked in fp32 (GPTQOptions.factor_dtype) against the float64 one: time, and how far apart."""
    from quantkit.quant.gptq import inverse_hessian_cholesky

    h = hessian(k, tokens)
    got: dict[str, torch.Tensor] = {}
    forms = {"float64": torch.float64, "ours": torch.float32}
    times = alternate({name: (lambda d=d, name=name: timed(lambda: inverse_hessian_cholesky(h, 0.01, 0, dtype=d)[0],
                                                             got, name)) for name, d in forms.items()}, rounds)
    same = float((got["ours"] == got["float64"]).double().mean())
    rel = (got["ours"] - got["float64"]).abs() / got["float64"].abs().max()
    print(f"{report('factor fp32', k, times, 'float64', rounds)}; fp32 entries equal to the float64 factor's "
          f"{same:.6f}, largest difference {float(rel.max()):.1e} of max|U|, median {float(rel.median()):.1e}")
    if thread_check:
        print(f"factor fp32 K={k}: at 1 and {threads} threads: {threads_differ(h, threads, torch.float32)} of "
              f"{k * k} fp32 entries differ")


def bench_hessian(k: int, tokens: int, rounds: int) -> None:
    from quantkit.quant.gptq import accumulate_hessian

    g = torch.Generator().manual_seed(k)
    batches = [torch.randn(tokens // 2, k, generator=g).bfloat16() for _ in range(2)]
    got: dict[str, torch.Tensor] = {}
    times = alternate({"previous": lambda: timed(lambda: fold(previous_accumulate, batches), got, "previous"),
                       "ours": lambda: timed(lambda: fold(accumulate_hessian, batches), got, "ours")}, rounds)
    print(f"{report('hessian', k, times, 'previous', rounds)}; bit-identical: {torch.equal(got['previous'], got['ours'])}")


FACTOR_STEPS = {"factor": bench_factor, "factor-fp32": bench_factor_fp32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="factor,hessian", help="comma-separated: factor, factor-fp32, hessian")
    ap.add_argument("--k", default="4096,14336", help="comma-separated K (H is K x K)")
    ap.add_argument("--tokens", type=int, default=8192)
    add_round_options(ap, rounds=3, threads=2)
    ap.add_argument("--thread-check", action="store_true", help="factor: ours at 1 and --threads threads, bits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for step in args.steps.split(","):
        for k in (int(v) for v in args.k.split(",")):
            if step in FACTOR_STEPS:
                FACTOR_STEPS[step](k, args.tokens, args.rounds, args.thread_check, args.threads)
            else:
                bench_hessian(k, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
