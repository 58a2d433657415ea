"""`quantkit check QDIR`: the structure of every packed layer against its config, then its outputs
(the model path and the Triton kernel) against an independent dequantization and (with --original)
the original float weights. Exit 1 when a layer fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors


def register(app: typer.Typer) -> None:
    app.command("check")(check)


@one_line_errors
def check(
    qdir: str = typer.Argument(..., help="Quantized checkpoint folder (GPTQ v1/v2, AWQ GEMM or compressed-tensors pack-quantized)."),
    original: str = typer.Option(None, "--original", help="The float model it came from (folder or hub id): "
                                 "also report each layer's relative output error against it."),
    backend: str = typer.Option("auto", "--backend", help="triton, torch, or auto (the Triton kernel when triton is "
                                "installed: compiled on a GPU, in its interpreter on a sample of each layer on "
                                "the CPU; torch: the model path only)."),
    max_rel_error: float = typer.Option(None, "--max-rel-error", help="Fail a layer whose relative output error "
                                        "against --original exceeds this (default 0.3).", min=0.0),
    calib: str = typer.Option(None, "--calib", help="Input text: a .txt/.jsonl file, folder or recipe "
                              "(default: the project's synthetic stories)."),
    nsamples: int = typer.Option(4, "--nsamples", min=1, help="Windows of text run through the model."),
    seqlen: int = typer.Option(128, "--seqlen", min=8, help="Tokens per window."),
    max_rows: int = typer.Option(256, "--max-rows", min=1, help="Rows of each layer's input that are checked."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N."),
    output: Path = typer.Option(None, "--output", help="Also write the full report as JSON here."),
    tp: str = typer.Option("2,4,8", "--tp", help="Tensor-parallel degrees to check the vLLM splits at."),
) -> None:
    """Check QDIR: every packed layer's structure, and its outputs against an independent dequantization."""
    from quantkit.check.checkpoint import DEFAULT_MAX_REL_ERROR, check_checkpoint

    report = check_checkpoint(qdir, original, backend,
                              DEFAULT_MAX_REL_ERROR if max_rel_error is None else max_rel_error,
                              calib=calib, nsamples=nsamples, seqlen=seqlen, max_rows=max_rows, device=device)
    print_report(report)
    from quantkit.commands.fast_path import fast_path_for, parse_tps, print_fast_paths

    fast = fast_path_for(qdir, parse_tps(tp))
    print_fast_paths(fast)
    if output is not None:
        write_json({**report.to_dict(), "vllm": fast.to_dict()}, output)
    if not report.passed:
        console.print(f"[bold red]check failed[/]: {failure_summary(report)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def failure_summary(report) -> str:
    """The layers that failed (the first one's problem), then those that could not be checked because of them."""
    failed, unchecked, total = report.failures, report.not_checkable, len(report.layers)
    parts = [f"{len(failed)} of {total} layers ({failed[0].name}: {failed[0].problems[0]})"] if failed else []
    if unchecked:
        parts.append(f"{len(unchecked)} of {total} layers not checkable ({unchecked[0].not_checkable})")
    return "; ".join(parts)


def print_report(report) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"quantkit check: {report.path} ({report.layout}, {report.bits}-bit, group "
                        f"{report.group_size}, {report.dtype} on {report.device}, backend {report.backend})")
    table.add_column("layer")
    table.add_column("N x K", justify="right")
    table.add_column("structure\n(vs config)", justify="center")
    table.add_column("model path vs\nindep. dequant", justify="right")
    table.add_column("Triton kernel vs\nindep. dequant", justify="right")
    table.add_column("rows\n(kernel rows x cols)", justify="right")
    table.add_column("error vs\noriginal", justify="right")
    table.add_column("", justify="center")
    for layer in report.layers:
        kernel_sample = f" ({layer.kernel_rows} x {layer.kernel_cols})" if layer.kernel_diff is not None else ""
        table.add_row(layer.name, f"{layer.out_features} x {layer.in_features}",
                      "ok" if not layer.structure else "[bold red]bad[/]",
                      _diff(layer.model_diff), _diff(layer.kernel_diff), f"{layer.rows}{kernel_sample}",
                      "-" if layer.rel_error is None else f"{layer.rel_error:.4f}",
                      _status(layer))
    (Console() if sys.stdout.isatty() else Console(width=160)).print(table)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)
    errors = [layer.rel_error for layer in report.layers if layer.rel_error is not None]
    if errors:
        console.print(f"error vs original: mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f} "
                      f"(limit {report.max_rel_error})")


def _status(layer) -> str:
    if layer.problems:
        return "[bold red]FAIL[/]"
    return "[green]ok[/]" if layer.passed else "[yellow]n/a[/]"  # n/a: not checkable (its inputs were not finite)


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def write_json(data: dict, output: Path) -> None:
    """Write to a temporary file beside `output`, then rename it into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(_finite(data), indent=2) + "\n")
    os.replace(tmp, output)


def _finite(value):
    """JSON has no inf or NaN: write them as the strings "inf" / "nan"."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
