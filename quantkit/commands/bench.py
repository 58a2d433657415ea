"""`quantkit bench ...`: benchmarks as commands. `quantkit bench serve` measures an OpenAI-compatible server;
`quantkit bench engine` runs the engine on fixed workloads, beside vLLM's CPU build when given its venv."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors
from quantkit.errors import QuantkitError

bench_app = typer.Typer(name="bench", help=("Benchmarks: `serve` measures a running OpenAI-compatible server, "
                                           "`engine` the engine beside vLLM's CPU build."),
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
    max_failed: float = typer.Option(0.0, "--max-failed", help="Share of requests (0..1) that may fail before the "
                                     "run exits 1; by default any failed request fails it."),
    output: Path | None = typer.Option(None, "--output", help="Write the report here as JSON."),
) -> None:
    """Benchmark a running server (quantkit serve or vllm serve): throughput, TTFT, TPOT, ITL, E2E."""
    import httpx
    from rich.console import Console

    from quantkit.bench.serve import BenchConfig, failure_lines, run, table
    from quantkit.commands.generate import read_prompts

    if not 0 <= max_failed <= 1:
        raise QuantkitError(f"--max-failed {max_failed:g}: expected a share of the requests, 0 to 1")
    cfg = BenchConfig(base_url.rstrip("/"), endpoint, model, num_prompts, request_rate, max_concurrency,
                      random_input_len, random_output_len,
                      read_prompts(prompts_file) if prompts_file else None, ignore_eos,
                      api_key or os.environ.get("OPENAI_API_KEY"), tokenizer, seed)
    try:
        rep = asyncio.run(run(cfg))
    except httpx.HTTPError as exc:
        raise QuantkitError(f"{base_url}: {type(exc).__name__}: {exc}") from exc
    Console().print(table(rep))  # the measurement is the result: stdout
    if output is not None:
        write_json(output, rep)
        console.print(f"wrote {output}", highlight=False)
    lines, failed = failure_lines(rep, max_failed)
    for i, line in enumerate(lines):
        console.print(("[bold red]bench serve:[/] " if i == 0 else "") + line, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)


@bench_app.command("engine")
@one_line_errors
def bench_engine(
    model: str | None = typer.Argument(None, help="A checkpoint (float, GPTQ or AWQ): folder or hub id. Default: the "
                                                  "embedded benchmark model, a random Llama of hidden 1024, 8 layers."),
    against_vllm: Path | None = typer.Option(None, "--against-vllm", metavar="VENV",
                                             help="A venv with vLLM's CPU build: run it beside, on the same prompts."),
    threads: int = typer.Option(2, "--threads", help="CPU threads for both engines."),
    rounds: int = typer.Option(3, "--rounds", help="Alternating rounds; the median counts."),
    workloads: str = typer.Option("a,b,c", "--workloads",
                                  help="a: 64 prompts x 128 in, 128 out; b: 32 prompts on a shared 512-token prefix "
                                       "+ 32 own, 32 out; c: one request, 128 in, 128 out; d8, d32: decode "
                                       "throughput at 8 and 32 concurrent sequences (128 in, 128 out, fresh "
                                       "prompts)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (quantkit's pick for this CPU), bfloat16 or float32."),
    gptq: bool = typer.Option(False, "--gptq", help="Embedded model: also its 4-bit GPTQ checkpoint (RTN, group 128)."),
    gptq_only: bool = typer.Option(False, "--gptq-only", help="Embedded model: only its 4-bit GPTQ checkpoint."),
    vllm_log: Path = typer.Option(Path("out/vllm-bench.log"), "--vllm-log", help="Where vLLM's stderr goes."),
    output: Path | None = typer.Option(None, "--output", help="Write the report here as JSON."),
    cpu_int8_activations: bool = typer.Option(False, "--cpu-int8-activations",
                                              help="quantkit's 4-bit linears with activations rounded to int8 "
                                                   "(W4A8), as generate/serve --cpu-int8-activations."),
) -> None:
    """Output tokens/s and TTFT of the engine on fixed workloads (token-id prompts, greedy, EOS ignored), beside
    vLLM's CPU build with --against-vllm: same model, prompts and threads, alternating rounds."""
    from quantkit.bench.engine_vs_vllm import EngineBenchConfig, comparisons, measurements
    from quantkit.model.checkpoint import resolve_model_path
    from quantkit.progress import no_transformers_bars, progress_bar

    cfg = EngineBenchConfig(model=None if model is None else resolve_model_path(model), vllm_venv=against_vllm,
                            threads=threads, rounds=rounds, dtype=dtype, gptq=gptq, gptq_only=gptq_only,
                            workloads=tuple(w.strip() for w in workloads.split(",") if w.strip()), vllm_log=vllm_log,
                            cpu_int8_activations=cpu_int8_activations)
    with progress_bar("Measuring", measurements(cfg)) as bar, no_transformers_bars():
        reports = comparisons(cfg, bar)
    for c in reports:
        console.print(engine_table(c))
        if c.vllm_error:
            console.print(f"[yellow]vLLM did not run {c.label}[/]: {c.vllm_error}", highlight=False)
        for line in c.vllm_kernels:
            console.print(f"vLLM: {line}", highlight=False)
    if output is not None:
        write_json(output, {"comparisons": [c.as_dict() for c in reports]})
        console.print(f"wrote {output}", highlight=False)


def engine_table(c):
    """A rich table of one model's comparison: per workload, each system's median tok/s and TTFT, and the ratios."""
    from rich.table import Table

    lo, hi = c.load_average
    t = Table(title=f"{c.label}: {c.dtype}, {c.threads} threads, median of {c.rounds} rounds "
                    f"(load average {lo:.1f}-{hi:.1f}); start-up "
                    + ", ".join(f"{n} {s:.1f} s" for n, s in c.startup_s.items()),
              caption=f"quantkit {c.quantkit_weights}")
    systems = list(c.results[0].tok_s) if c.results else ["quantkit"]
    decode = any(r.decode_tok_s for r in c.results)  # (d8), (d32): the decode rate, prefill's time taken out
    t.add_column("workload")
    for name in systems:
        t.add_column(f"{name} tok/s", justify="right")
        t.add_column(f"{name} TTFT", justify="right")
        if decode:
            t.add_column(f"{name} decode tok/s", justify="right")
    if "vLLM" in systems:
        t.add_column("tok/s ratio", justify="right")
        t.add_column("TTFT ratio", justify="right")
        if decode:
            t.add_column("decode ratio", justify="right")
    for r in c.results:
        row = [f"({r.workload})"]
        for name in systems:
            row += [f"{r.median_tok_s(name):.1f}", f"{r.median_ttft_s(name) * 1e3:.1f} ms"]
            if decode:
                rate = r.median_decode_tok_s(name)
                row.append("" if rate is None else f"{rate:.1f}")
        if (ratios := r.ratios()) is not None:
            row += [f"{ratios[0]:.2f}x", f"{ratios[1]:.2f}x"]
            if decode:
                rates = r.median_decode_tok_s("quantkit"), r.median_decode_tok_s("vLLM")
                row.append(f"{rates[0] / rates[1]:.2f}x" if None not in rates else "")
        t.add_row(*row)
    return t


def write_json(path: Path, obj: dict) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
