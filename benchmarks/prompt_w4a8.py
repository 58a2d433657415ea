"""Time to first token with the prompt rows W4A16 (`cpu_int8_prefill=False`) against the engine's default (W4A8
prompts where linear_choice.prompt_q8_not_default allows: every CPU with the int8-activation kernel, AMX ones on their
AMX-INT8 tiles): two engines on one 4-bit checkpoint in one process, a fresh random prompt each time (no prefix
cache), max_tokens 1, the order flipped each round; the median TTFT of each and the median of the per-round ratios.

    python benchmarks/prompt_w4a8.py ~/.cache/quantkit/real-shapes/llama-3.2-1b-gptq --lengths 128,512,2048 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.bench.rounds import alternate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a 4-bit checkpoint")
    ap.add_argument("--lengths", default="128,512,2048", help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from quantkit.engine import LLM, SamplingParams

    lengths = [int(v) for v in args.lengths.split(",")]
    engines = {name: LLM(args.model, max_model_len=max(lengths) + 8, max_num_seqs=4, num_threads=args.threads,
                         cpu_int8_prefill=prefill, enable_prefix_caching=False)
               for name, prefill in (("W4A16 prompts", False), ("default", None))}
    gen = torch.Generator().manual_seed(0)
    vocab = engines["default"].engine.model.shape.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(llm, n: int) -> float:
        prompt = torch.randint(100, vocab, (n,), generator=gen).tolist()
        t = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - t

    print(f"{args.model}, {args.threads} threads, median of {args.rounds} rounds")
    print("| prompt tokens | W4A16 prompts TTFT ms | default TTFT ms | W4A16 / default |")
    print("|---|---|---|---|")
    for n in lengths:
        for llm in engines.values():
            ttft(llm, n)  # warm-up at this length
        times = alternate({name: (lambda llm=llm: ttft(llm, n)) for name, llm in engines.items()}, args.rounds)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["W4A16 prompts"], times["default"]))
        print(f"| {n} | {med['W4A16 prompts']:.0f} | {med['default']:.0f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
