"""`quantkit plan MODEL`: weights and KV cache per GPU, fp16 beside INT-n, from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


@one_line_errors
def plan(
    model: str = typer.Argument(..., help="A checkpoint folder (or its config.json), or a hub id (config.json only is downloaded)."),
    gpu_memory: str = typer.Option("80GiB", "--gpu-memory", help="Memory of one GPU, e.g. 80GiB, 24GiB, 40GB."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="Fraction of it for weights + KV cache."),
    max_model_len: int = typer.Option(None, "--max-model-len", min=1, help="Tokens per sequence (default: the model's context)."),
    bits: int = typer.Option(4, "--bits", help="Bits of the packed weights."),
    group_size: int = typer.Option(128, "--group-size", help="Group size (-1: per channel)."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="auto (fp16/bf16), fp16, bf16, fp32, fp8."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel degree: weights and KV heads split over this many GPUs."),
    block_size: int = typer.Option(16, "--block-size", min=1, help="Tokens per KV block."),
    kv_cache_memory: str = typer.Option(None, "--kv-cache-memory", help="A fixed KV cache size per GPU, e.g. 4GiB "
                                        "(vLLM's --kv-cache-memory-bytes; on vLLM-CPU, VLLM_CPU_KVCACHE_SPACE)."),
    output: Path = typer.Option(None, "--output", help="Also write the plan as JSON here."),
) -> None:
    """Size a deployment before making it: what fits on each GPU in fp16 and in INT-n."""
    from quantkit.model.checkpoint import resolve_config
    from quantkit.plan import make_plan, parse_bytes

    result = make_plan(model, resolve_config(model), parse_bytes(gpu_memory), gpu_memory_utilization, max_model_len,
                       bits, group_size, kv_dtype, tp, block_size,
                       None if kv_cache_memory is None else parse_bytes(kv_cache_memory))
    _print(result)
    if output is not None:
        output.write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.2f} MiB"


def _print(p) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    s = p.shape
    table = Table(title=f"quantkit plan: {p.model} on {p.tp} x {_gib(p.gpu_memory_bytes)} at "
                        f"{p.gpu_memory_utilization:g}, max_model_len {p.max_model_len}, KV {p.kv_dtype}")
    table.add_column("per GPU")
    for col in p.columns:
        table.add_column(col.label, justify="right")
    rows = [
        ("weights (all GPUs)", lambda c: _gib(c.weight_bytes_total)),
        ("weights", lambda c: _gib(c.weight_bytes_per_gpu)),
        ("KV budget", lambda c: _gib(c.kv_budget_bytes_per_gpu)),
        ("KV bytes / token", lambda c: f"{c.kv_bytes_per_token_per_gpu:,}"),
        (f"KV blocks of {p.block_size}", lambda c: f"{c.kv_blocks_per_gpu:,}"),
        ("KV tokens", lambda c: f"{c.kv_tokens:,}"),
        (f"sequences of {p.max_model_len}", lambda c: f"{c.concurrent_sequences:,}"),
        ("fits one sequence", lambda c: "yes" if c.fits else "NO"),
    ]
    for label, cell in rows:
        table.add_row(label, *[cell(c) for c in p.columns])
    out = Console() if sys.stdout.isatty() else Console(width=120)  # the plan is the result: stdout
    out.print(f"{s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads of {s.head_dim}, "
              f"vocab {s.vocab}, {s.max_position_embeddings} positions", highlight=False)
    out.print(table)
    if p.moe is not None:
        m = p.moe
        out.print(f"MoE: {m.experts} experts a layer, {m.top_k} per token: {m.active_params / 1e9:.3g}B of "
                  f"{m.total_params / 1e9:.3g}B parameters active per token; the experts' weights "
                  f"{_gib(m.expert_bytes_fp16)} in fp16, {_gib(m.expert_bytes_packed)} in INT{p.bits} "
                  f"g{p.group_size}", highlight=False)
    for note in p.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
