"""What structured outputs cost the engine's decode: the same batch of requests with and without a JSON schema, in
one process, alternating rounds (issue 37's goal: at most 10% of decode throughput at batch 8).

    python benchmarks/structured_outputs.py [--batch 8] [--rounds 3] [--threads 2] [--max-tokens 128]

Model: quantkit bench engine's embedded benchmark model (a random Llama, hidden 1024, 8 layers, vocab 32000, bf16
where the CPU computes it natively), with the byte-level BPE of benchmarks/grammar_engines.py (26k tokens trained on
WikiText-2) as its tokenizer, so the mask is computed over a realistic vocabulary. Schema: an object with one free
string, so every sequence runs to --max-tokens under the mask (a random model never closes the string). Prints
output tokens/s of each, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_engines import wikitext_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The flags of this benchmark and of structured_outputs_http.py."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    return ap


def bench_model(folder: Path) -> Path:
    """quantkit bench engine's random Llama in `folder`, with the WikiText-2 byte-level BPE as its tokenizer."""
    from quantkit.bench.engine_vs_vllm import make_dense

    model = make_dense(folder)
    wikitext_tokenizer().save_pretrained(model)
    return model


def random_prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of 64 token ids, the same every run."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 26000, (64,), generator=g).tolist() for _ in range(batch)]


def main(argv=None) -> None:
    from quantkit.bench.rounds import alternate
    from quantkit.engine import LLM, SamplingParams, StructuredOutputsParams

    args = parser(__doc__, rounds=3).parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        llm = LLM(str(bench_model(Path(tmp))), max_num_seqs=args.batch, max_model_len=512)
        prompts = random_prompts(args.batch)
        free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        held = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
        start = time.perf_counter()
        llm.engine.grammars.compile(held.structured_outputs)
        compile_ms = (time.perf_counter() - start) * 1e3
        llm.generate(prompts, free)  # warm-up

        def rate(params: SamplingParams) -> float:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

        rates = alternate({"free": lambda: rate(free), "json schema": lambda: rate(held)}, args.rounds)
        free_s, held_s = statistics.median(rates["free"]), statistics.median(rates["json schema"])
        print(f"batch {args.batch}, {args.max_tokens} tokens each, {args.threads} threads, dtype "
              f"{str(llm.engine.dtype).removeprefix('torch.')}; schema compiled in {compile_ms:.1f} ms (once)")
        print(f"free text: {free_s:.1f} tok/s; json schema: {held_s:.1f} tok/s; ratio {held_s / free_s:.3f} "
              f"(rounds: {[round(x) for x in rates['free']]} / {[round(x) for x in rates['json schema']]})")

if __name__ == "__main__":
    main()
