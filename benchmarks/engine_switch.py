"""Does one of the engine's CPU switches speed up batch-1 decode? Two engines on the same checkpoint in one process,
one with the switch off and one with it on (`--switch cpu_huge_pages`: weights in transparent huge pages;
`cpu_int8_lm_head`: the float lm_head held in int8), decoding the same greedy 128 tokens after a 128-token prompt in
alternating rounds (the order flipped each round); prints each round's tok/s and their ratio, the ratio of medians,
whether the greedy tokens agree, what each engine's weights take (read per token) and the resident memory each added
at load.

    python benchmarks/engine_switch.py ~/.cache/quantkit/real-shapes/llama-3.2-1b-gptq --switch cpu_huge_pages
    python benchmarks/engine_switch.py ~/.cache/quantkit/real-shapes/llama-3.2-1b-gptq --switch cpu_int8_lm_head
"""

from __future__ import annotations

import argparse
import statistics

SWITCHES = ("cpu_huge_pages", "cpu_int8_lm_head")  # EngineConfig's on/off fields a run can flip


def rss_mib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a checkpoint (4-bit for the int8 lm_head's default to apply)")
    ap.add_argument("--switch", choices=SWITCHES, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: bf16 where the CPU computes it)")
    args = ap.parse_args()

    from quantkit.engine import LLM, SamplingParams
    from quantkit.engine.weights import WeightMemory

    llms = {}
    for name, on in (("off", False), ("on", True)):
        before = rss_mib()
        llms[name] = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=1, num_threads=args.threads,
                         enable_prefix_caching=False, **{args.switch: on})
        memory = WeightMemory.of(llms[name].engine.model)
        print(f"{args.switch} {name}: {memory.read_per_token / 2**20:.0f} MiB read a token; "
              f"{llms[name].engine.huge_pages.describe()}; RSS +{rss_mib() - before} MiB at load", flush=True)
    prompt = list(range(100, 228))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tokens = {n: llm.generate([prompt], params)[0].outputs[0].token_ids for n, llm in llms.items()}  # warm-up
    same = next((i for i, (a, b) in enumerate(zip(tokens["off"], tokens["on"])) if a != b), len(tokens["on"]))
    print(f"greedy tokens equal for the first {same} of {len(tokens['on'])}", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in llms}
    for r in range(args.rounds):
        for n in list(llms) if r % 2 == 0 else list(llms)[::-1]:
            m = llms[n].generate([prompt], params)[0].metrics
            rates[n].append((args.tokens - 1) / m.decode_time)
        print(f"round {r + 1}: off {rates['off'][-1]:.2f}, on {rates['on'][-1]:.2f} tok/s; "
              f"{rates['on'][-1] / rates['off'][-1]:.3f}x", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(f"medians: off {med['off']:.2f}, on {med['on']:.2f} tok/s; on / off {med['on'] / med['off']:.3f}x")


if __name__ == "__main__":
    main()
