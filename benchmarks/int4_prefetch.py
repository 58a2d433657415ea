"""Batch-1 decode's CPU kernels (M = 1) with their codes prefetched at several distances ahead of the loads
(kernels/csrc/stream_ahead.h, the `set_stream_ahead` switch), against none, in one process. Three kernels, each over
what an 8B model's decode step reads through it (bf16 activations where the AVX-512 BF16 kernel runs, else fp32):

  - W4A16 (the AVX-512 BF16 lane tile; on AVX2 the fp32 kernel's 16-bit x tiles): Llama-3.1-8B's layer linears
    (q|k|v, o, gate|up, down), three copies;
  - W4A8 (`--cpu-int8-activations`: the VNNI kernel, or the AVX2 maddubs one): the same weights;
  - the int8 lm_head (`--cpu-int8-lm-head`): 128256 x 4096, which prefetches nothing itself (its row: the switch's
    cost, none, and the host's drift).

Every distance is timed in each round, in a rotated order (the host's bandwidth drifts within a minute), and its
ratio to the first distance is taken per round. With `--engine MODEL` the same rounds time the engine's batch-1
decode of a 4-bit checkpoint instead (one engine, greedy, `--tokens` a round, prompt excluded).

    python benchmarks/int4_prefetch.py --distances 0,2048,3072,4096,6144 --rounds 20 --threads 2
    python benchmarks/int4_prefetch.py --engine ~/.cache/quantkit/real-shapes/llama-3.1-8b-gptq --distances 0,4096 \
        --rounds 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # q|k|v, o, gate|up, down at the 8B shape
VOCAB, HIDDEN = 128256, 4096


def kernels(copies: int) -> dict[str, tuple[Callable[[], float | None], int]]:
    """name -> (one pass over its weights at M = 1, the bytes of codes that pass reads). bf16 activations where the
    AVX-512 BF16 kernel runs, else fp32 (the AVX2 kernels: W4A16 on its 16-bit x tiles, W4A8 on maddubs)."""
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize
    from quantkit.kernels.int4_cpu import bf16_kernel, direct_call, int4_blocked_linear, q8_kernel, repack
    from quantkit.kernels.int8_cpu import int8_kernel_available, pack_int8

    ws = [(repack(pack(rtn_quantize(torch.randn(n, k) * 0.02, QuantScheme(4, 128, True)), "gptq")), k)
          for _ in range(copies) for n, k in SHAPES]
    dtype = torch.bfloat16 if bf16_kernel(ws[0][0]) else torch.float32
    xs = {k: torch.randn(1, k).to(dtype) for _, k in SHAPES}
    int4_bytes = sum(n * k // 2 for n, k in SHAPES) * copies

    def w4a16() -> None:
        for w, k in ws:
            int4_blocked_linear(xs[k], w, None, dense_from_m=2)

    out = {"W4A16": (w4a16, int4_bytes)}
    if dtype == torch.float32 or q8_kernel(ws[0][0]):  # the AVX2 int8-activation kernel is built everywhere
        calls = [(direct_call(w, "q8", 2, dtype), k) for w, k in ws]

        def w4a8() -> None:
            for call, k in calls:
                call(xs[k])

        out["W4A8"] = (w4a8, int4_bytes)
    if int8_kernel_available(dtype):
        from quantkit.kernels.int8_cpu import Int8Linear

        head, x = Int8Linear(pack_int8(torch.randn(VOCAB, HIDDEN) * 0.02, 128)), torch.randn(1, HIDDEN).to(dtype)

        def lm_head() -> None:
            head(x)

        out["int8 lm_head"] = (lm_head, VOCAB * HIDDEN)
    return out


def engine_decode(model: str, threads: int, tokens: int) -> dict[str, tuple[Callable[[], float | None], int]]:
    """The engine's batch-1 decode of `tokens` tokens: a run of tokens + 1 less a run of one token on the same
    16-token prompt (the prefill and first token cancel), and the weight bytes a step reads (all but the embedding,
    of which a step reads one row)."""
    from quantkit.engine import LLM, SamplingParams
    from quantkit.engine.weights import WeightMemory

    llm = LLM(model, num_threads=threads, max_num_seqs=1, max_model_len=256, enable_prefix_caching=False)
    prompt = list(range(100, 116))
    one, many = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    memory = WeightMemory.of(llm.engine.model)

    def run() -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        t1 = time.perf_counter()
        llm.generate([prompt], many)
        return (time.perf_counter() - t1) - (t1 - t0)

    return {"engine decode": (run, (memory.resident - memory.embedding) * tokens)}


def main() -> None:
    from quantkit.kernels.int4_cpu import extension

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distances", default="0,2048,3072,4096,6144", help="bytes ahead; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", help="a 4-bit checkpoint: time its batch-1 decode instead of the kernels")
    ap.add_argument("--tokens", type=int, default=32, help="--engine: tokens decoded a run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    distances = [int(d) for d in args.distances.split(",")]
    ext = extension()
    runs = engine_decode(args.engine, args.threads, args.tokens) if args.engine else kernels(args.copies)

    def timed(fn: Callable[[], float | None]) -> float:
        """fn's own measure where it returns one, else its wall time."""
        t = time.perf_counter()
        own = fn()
        return own if isinstance(own, float) else time.perf_counter() - t

    for fn, _ in runs.values():
        fn()
    times = {(name, d): [] for name in runs for d in distances}
    default = ext.dev.set_stream_ahead(distances[0])
    try:
        for r in range(args.rounds):
            for d in distances[r % len(distances):] + distances[:r % len(distances)]:
                ext.dev.set_stream_ahead(d)
                for name, (fn, _) in runs.items():
                    times[name, d].append(min(timed(fn) for _ in range(3)))
    finally:
        ext.dev.set_stream_ahead(default)
    print(f"{args.threads} threads, {args.rounds} rounds; the kernel's default distance: {default} bytes")
    print(f"{'kernel':>13} {'distance':>9} {'median GB/s':>12} {'x baseline (median of rounds)':>30} {'range':>14}")
    for name, (_, size) in runs.items():
        base = times[name, distances[0]]
        for d in distances:
            ratios = [b / t for b, t in zip(base, times[name, d])]
            print(f"{name:>13} {d:>9} {size / statistics.median(times[name, d]) / 1e9:>12.1f} "
                  f"{statistics.median(ratios):>30.3f} {min(ratios):>6.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
