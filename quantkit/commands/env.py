"""`quantkit env`: versions, the CPU and its kernel level, each CPU kernel on or off and why, threads, GPUs."""

from __future__ import annotations

import json

import typer

from quantkit.commands.common import one_line_errors


def register(app: typer.Typer) -> None:
    app.command("env")(env)


@one_line_errors
def env(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts).")) -> None:
    """What this machine and install give quantkit: the CPU level its kernels run at, and each kernel on or off."""
    from quantkit.env_report import collect

    report = collect()
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
        return
    _print(report)


def _print(r) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(highlight=False, soft_wrap=True)
    out.print("[bold]quantkit env[/]")
    out.print("versions: " + ", ".join(f"{k} {v}" for k, v in r.versions.items()) + f"; Python {r.python}")
    out.print(f"platform: {r.platform}")
    out.print(f"CPU: {r.cpu_model}; {r.threads} torch threads; AMX tiles granted: {'yes' if r.amx_granted else 'no'}")
    missing = [f for f, present in r.cpu_flags.items() if not present]
    out.print(f"CPU level: [bold]{r.cpu_level}[/] ({r.cpu_level_why}); the CPU runs up to {r.machine_level}"
              + (f"; missing: {' '.join(missing)}" if missing else ""))
    table = Table(title="CPU kernels")
    for col in ("kernel", "state", "path, or why not"):
        table.add_column(col)
    for k in r.kernels:
        table.add_row(k["kernel"], "[green]on[/]" if k["active"] else "[red]off[/]", k["detail"])
    out.print(table)
    choice = Table(title="4-bit linears (g128, no bias): kernels/linear_choice.py's table, first row that runs wins")
    choice.add_column("kernel")
    for dtype in r.linear_choice:
        choice.add_column(f"{dtype} activations")
    names = [name for name, _ in next(iter(r.linear_choice.values()), [])]
    for i, name in enumerate(names):
        cells = [r.linear_choice[dtype][i][1] for dtype in r.linear_choice]
        choice.add_row(name, *(f"[green]{c}[/]" if c == "chosen" else c for c in cells))
    out.print(choice)
    prompts = ", ".join(f"{dtype} {how}" for dtype, how in r.prompt_arithmetic.items())
    out.print(f"4-bit checkpoints: prompt tokens by default {prompts}; generated tokens W4A16 "
              "(--cpu-int8-prefill/--no-cpu-int8-prefill, --cpu-int8-activations)")
    out.print(f"engine weights on CPU: {r.weight_pages} (--cpu-huge-pages/--no-cpu-huge-pages)")
    for name, where in r.kernel_files.items():
        out.print(f"{name}: {where}")
    out.print("GPUs: " + ("; ".join(r.gpus) if r.gpus else "none"))
