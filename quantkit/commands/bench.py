"""`quantkit bench ...`: benchmarks as commands. `quantkit bench serve` measures an OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors
from quantkit.errors import QuantkitError

bench_app = typer.Typer(name="bench", help="Benchmarks: `serve` measures a running OpenAI-compatible server.",
                        no_args_is_help=True, add_completion=False)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("serve")
@one_line_errors
def bench_serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url"),
    endpoint: str = typer.Option("/v1/completions", "--endpoint", help="/v1/completions or /v1/chat/completions."),
    model: str | None = typer.Option(None, "--model", help="Default: the server's first model."),
    num_prompts: int = typer.Option(200, "--num-prompts"),
    request_rate: float = typer.Option(math.inf, "--request-rate", help="Poisson arrivals per second (inf: all at once)."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency"),
    random_input_len: int = typer.Option(256, "--random-input-len"),
    random_output_len: int = typer.Option(128, "--random-output-len"),
    prompts_file: Path | None = typer.Option(None, "--prompts-file", help="One prompt per line, or JSONL with \"prompt\"."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    api_key: str | None = typer.Option(None, "--api-key", help="Default: OPENAI_API_KEY."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Local tokenizer for prompts (default: /tokenize)."),
    seed: int = typer.Option(0, "--seed"),
    output: Path | None = typer.Option(None, "--output", help="Write the report here as JSON."),
) -> None:
    """Benchmark a running server (quantkit serve or vllm serve): throughput, TTFT, TPOT, ITL, E2E."""
    import httpx

    from quantkit.bench.serve import BenchConfig, run, table
    from quantkit.commands.generate import read_prompts

    cfg = BenchConfig(base_url.rstrip("/"), endpoint, model, num_prompts, request_rate, max_concurrency,
                      random_input_len, random_output_len,
                      read_prompts(prompts_file) if prompts_file else None, ignore_eos,
                      api_key or os.environ.get("OPENAI_API_KEY"), tokenizer, seed)
    try:
        rep = asyncio.run(run(cfg))
    except httpx.HTTPError as exc:
        raise QuantkitError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
    console.print(table(rep))
    if output is not None:
        write_json(output, rep)
        console.print(f"wrote {output}", highlight=False)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
