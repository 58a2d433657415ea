"""What a JSON schema costs over HTTP: batches of concurrent chat requests to `quantkit serve`, with and without
`response_format: json_schema`, alternating rounds (issue 37's goal: at most 10% of decode throughput at batch 8).
benchmarks/structured_outputs.py asks the same of the engine alone; this adds the server's share (parsing the
request, the spec, the responses).

    python benchmarks/structured_outputs_http.py [--batch 8] [--rounds 4] [--threads 2] [--max-tokens 128]

Model and tokenizer as benchmarks/structured_outputs.py (a random Llama of quantkit bench engine, hidden 1024, 8
layers; the 26k-token byte-level BPE of benchmarks/grammar_engines.py), served by `quantkit serve` in a subprocess on
a free loopback port. Each round sends --batch requests at once (completions, token-id prompts of 64 tokens, greedy,
ignore_eos, --max-tokens each) and counts the usage's completion tokens over the round's wall time. Prints the
median tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_engines import wikitext_tokenizer  # noqa: E402
from structured_outputs import SCHEMA  # noqa: E402

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
    from quantkit.bench.engine_vs_vllm import make_dense
    from quantkit.bench.serve_vs_vllm import free_port, start

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-structured-http-") as tmp:
        model = make_dense(Path(tmp))
        wikitext_tokenizer().save_pretrained(model)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start([sys.executable, "-m", "quantkit.cli", "serve", str(model), "--port", str(port),
                      "--threads", str(args.threads), "--max-num-seqs", str(args.batch), "--max-model-len", "512",
                      "--served-model-name", "bench", "--log-level", "warning"],
                     {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}, url)  # this checkout's quantkit
        try:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 26000, (64,), generator=g).tolist() for _ in range(args.batch)]
            asyncio.run(one_round(url, prompts, 8, held=True))  # warm-up; compiles the schema (once)
            asyncio.run(one_round(url, prompts, 8, held=False))
            rates: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.rounds):
                for held in ((False, True) if r % 2 == 0 else (True, False)):
                    rates[held].append(asyncio.run(one_round(url, prompts, args.max_tokens, held)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    free_s, held_s = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"HTTP, batch {args.batch}, {args.max_tokens} tokens each, {args.threads} threads, {args.rounds} rounds")
    print(f"free text: {free_s:.1f} tok/s; json schema: {held_s:.1f} tok/s; ratio {held_s / free_s:.3f} "
          f"(rounds: {[round(x) for x in rates[False]]} / {[round(x) for x in rates[True]]})")


if __name__ == "__main__":
    main()
