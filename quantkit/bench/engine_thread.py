"""Does it matter which thread builds the engine? One engine built and stepped in one thread, against one
built in a thread and stepped in another (what AsyncLLM did before it built the engine in its own thread).

  python -m quantkit.bench.engine_thread MODEL [--rounds 3] [--threads 2] [--dtype bfloat16]
      [--prompts 32] [--input-len 256] [--output-len 128]

torch's OpenMP pool belongs to the thread that opens a parallel region. A thread that only loaded the
weights (prepacking runs parallel regions) keeps a pool of its own; with two pools the process holds
more OpenMP threads than cores, and libgomp then barely spins between regions: its workers sleep and
are woken through the kernel, which small ops (norms, rotary) feel most. Each round runs both ways in
child processes, alternating (a fresh process each: the pools live as long as their threads), on random
prompts of their own (no prefix-cache hits), greedy with EOS ignored; the table gives output tokens/s
(median over the rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

WAYS = ("one thread", "built in another thread")


def child(args) -> None:
    """Build the engine, run `args.prompts` prompts once as warm-up and once timed; print tok/s as JSON."""
    import time

    import torch

    from quantkit.engine import LLM, SamplingParams

    def build():
        return LLM(args.model, num_threads=args.threads, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
                   max_num_seqs=args.prompts)

    def run(llm) -> float:
        g = torch.Generator().manual_seed(args.seed)
        vocab = llm.engine.tokenizer.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        rates = []
        for _ in range(2):  # warm-up, then timed; fresh prompts each
            prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.prompts)]
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        return rates[-1]

    builder, stepper = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    if args.child == WAYS[0]:
        rate = stepper.submit(lambda: run(build())).result()
    else:
        rate = stepper.submit(run, builder.submit(build).result()).result()
    print(json.dumps({"tok_s": rate}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS:
            argv = [sys.executable, "-m", "quantkit.bench.engine_thread", *sys.argv[1:], "--child", way,
                    "--seed", str(r)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            rates[way].append(json.loads(out.strip().splitlines()[-1])["tok_s"])
            print(f"round {r + 1}: {way}: {rates[way][-1]:.1f} tok/s", flush=True)
    one, split = (statistics.median(rates[w]) for w in WAYS)
    print(f"\n| engine | tok/s (median of {args.rounds}) |\n|---|---|")
    for way in WAYS:
        print(f"| {way} | {statistics.median(rates[way]):.1f} |")
    print(f"\none thread / built in another: **{one / split:.2f}x**")


if __name__ == "__main__":
    main()
