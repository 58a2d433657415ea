"""A 4-bit checkpoint's decode in the engine with its quantized q/k/v and gate/up fused into one kernel
call each and bf16 activations handed straight to the AVX-512 BF16 kernel, against the same engine
without either (the way it ran before), in one process, alternating.

  python -m quantkit.bench.int4_fusion MODEL [--threads 2] [--rounds 3] [--batches 1,8] [--max-tokens 128]

MODEL: a 4-bit GPTQ/AWQ checkpoint (e.g. the random Llama's, `python -m quantkit.bench.int4_engine
--make-only`). Prompts of 128 random token ids, greedy with EOS ignored; tok/s = new tokens / wall time of
the generate call (prefill included). Prints the median per batch size and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def load_pair(model: str, threads: int):
    """(fused + direct, neither): two engines on the same checkpoint."""
    from quantkit.engine import LLM, weights
    from quantkit.model.quant_linear import QuantLinear

    new = LLM(model, dtype="bfloat16", max_model_len=1024, num_threads=threads)
    fuse = weights.fuse_quantized_projections
    weights.fuse_quantized_projections = lambda m: 0
    try:
        old = LLM(model, dtype="bfloat16", max_model_len=1024, num_threads=threads)
    finally:
        weights.fuse_quantized_projections = fuse
    for m in old.engine.model.modules():
        if isinstance(m, QuantLinear):
            m._direct = None
    return new, old


def main() -> None:
    from quantkit.engine import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    new, old = load_pair(args.model, args.threads)
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: [torch.randint(3, 32000, (128,), generator=g).tolist() for _ in range(b)] for b in batches}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"fused + direct": new, "before": old}
    for llm in engines.values():
        llm.generate(prompts[batches[0]][:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tok_s = {(name, b): [] for name in engines for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            for name, llm in engines.items():
                t0 = time.perf_counter()
                llm.generate(prompts[b], params)
                tok_s[name, b].append(b * args.max_tokens / (time.perf_counter() - t0))
    print(f"{args.model}, bfloat16, {args.threads} threads, median of {args.rounds} alternating rounds")
    print("| batch | fused + direct tok/s | before tok/s | ratio | rounds (fused + direct; before) |\n|---|---|---|---|---|")
    for b in batches:
        a, z = (statistics.median(tok_s[name, b]) for name in engines)
        rounds = "; ".join(", ".join(f"{v:.1f}" for v in tok_s[name, b]) for name in engines)
        print(f"| {b} | {a:.1f} | {z:.1f} | {a / z:.2f}x | {rounds} |")


if __name__ == "__main__":
    main()
