"""What a JSON schema costs over HTTP: batches of concurrent chat requests to `quantkit serve`, with and without
`response_format: json_schema`, alternating rounds (issue 37's goal: at most 10% of decode throughput at batch 8).
benchmarks/structured_outputs.py asks the same of the engine alone; this adds the server's share (parsing the
request, the spec, the responses).

    python benchmarks/structured_outputs_http.py [--batch 8] [--rounds 4] [--threads 2] [--max-tokens 128]

Model and tokenizer as benchmarks/structured_outputs.py (a random Llama of quantkit bench engine, hidden 1024, 8
layers; the 26k-token byte-level BPE of benchmarks/grammar_engines.py), served by `quantkit serve` in a subprocess on
a free loopback port. Each round sends --batch requests at once (completions, token-id prompts of 64 tokens, greedy,
ignore_eos, --max-tokens each) and counts the usage's completion tokens over the round's wall time. Prints the
median tokens/s of each, their ratio, and the median of each round's ratio (its two runs are adjacent in time, so a
shared machine's drifting load cancels better).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_outputs import SCHEMA, bench_model, parser, random_prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}


async def one_round(url: str, prompts: list[list[int]], max_tokens: int, held: bool) -> float:
    """Output tokens/s of one batch of concurrent requests."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt):
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, **({"response_format": RESPONSE_FORMAT} if held else {})}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens / (time.perf_counter() - start)


def main(argv=None) -> None:
    from quantkit.bench.rounds import alternate
    from quantkit.bench.serve_vs_vllm import free_port, start

    args = parser(__doc__, rounds=4).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-structured-http-") as tmp:
        model = bench_model(Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start([sys.executable, "-m", "quantkit.cli", "serve", str(model), "--port", str(port),
                      "--threads", str(args.threads), "--max-num-seqs", str(args.batch), "--max-model-len", "512",
                      "--served-model-name", "bench", "--log-level", "warning"],
                     {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}, url)  # this checkout's quantkit
        try:
            prompts = random_prompts(args.batch)
            asyncio.run(one_round(url, prompts, 8, held=True))  # warm-up; compiles the schema (once)
            asyncio.run(one_round(url, prompts, 8, held=False))
            rates = alternate({held: lambda held=held: asyncio.run(one_round(url, prompts, args.max_tokens, held))
                               for held in (False, True)}, args.rounds)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    free_s, held_s = statistics.median(rates[False]), statistics.median(rates[True])
    paired = statistics.median(h / f for f, h in zip(rates[False], rates[True]))  # each round's two runs, adjacent
    print(f"HTTP, batch {args.batch}, {args.max_tokens} tokens each, {args.threads} threads, {args.rounds} rounds")
    print(f"free text: {free_s:.1f} tok/s; json schema: {held_s:.1f} tok/s; ratio {held_s / free_s:.3f}, median of "
          f"the rounds' ratios {paired:.3f} (rounds: {[round(x) for x in rates[False]]} / "
          f"{[round(x) for x in rates[True]]})")

if __name__ == "__main__":
    main()
