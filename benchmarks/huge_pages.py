"""Does batch-1 decode read faster with the engine's weights in transparent huge pages (`--cpu-huge-pages`, the
default; quantkit.engine.huge_pages)? Two engines on the same 4-bit checkpoint in one process, one with
`cpu_huge_pages=False`, decoding the same greedy 128 tokens after a 128-token prompt in alternating rounds (the
order flipped each round); prints each round's tok/s and their ratio, the ratio of medians, and the resident memory
each engine added at load.

    python benchmarks/huge_pages.py ~/.cache/quantkit/real-shapes/llama-3.2-1b-gptq --rounds 6 --threads 2
"""

from __future__ import annotations

import argparse
import statistics


def rss_mib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a 4-bit checkpoint")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    from quantkit.engine import LLM, SamplingParams

    llms = {}
    for name, on in (("4 KiB pages", False), ("huge pages", True)):
        before = rss_mib()
        llms[name] = LLM(args.model, dtype="bfloat16", max_model_len=512, max_num_seqs=1, num_threads=args.threads,
                         enable_prefix_caching=False, cpu_huge_pages=on)
        print(f"{name}: {llms[name].engine.huge_pages.describe()}; RSS +{rss_mib() - before} MiB at load", flush=True)
    prompt = list(range(100, 228))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tokens = {n: llm.generate([prompt], params)[0].outputs[0].token_ids for n, llm in llms.items()}  # warm-up
    print("greedy tokens equal:", tokens["4 KiB pages"] == tokens["huge pages"], flush=True)
    rates: dict[str, list[float]] = {n: [] for n in llms}
    for r in range(args.rounds):
        for n in list(llms) if r % 2 == 0 else list(llms)[::-1]:
            m = llms[n].generate([prompt], params)[0].metrics
            rates[n].append((args.tokens - 1) / m.decode_time)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in rates.items())
              + f" tok/s; {rates['huge pages'][-1] / rates['4 KiB pages'][-1]:.3f}x", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(f"medians: " + ", ".join(f"{n} {v:.2f}" for n, v in med.items())
          + f" tok/s; huge pages / 4 KiB pages {med['huge pages'] / med['4 KiB pages']:.3f}x")


if __name__ == "__main__":
    main()
