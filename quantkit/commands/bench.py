"""`quantkit bench ...`: benchmarks as commands. `quantkit bench serve` measures an OpenAI-compatible server."""

from __future__ import annotations

import typer

bench_app = typer.Typer(name="bench", help="Benchmarks: `serve` measures a running OpenAI-compatible server.",
                        no_args_is_help=True, add_completion=False)


def register(app: typer.Typer) -> None:
    from quantkit.commands import bench_serve

    bench_serve.register(bench_app)
    app.add_typer(bench_app, name="bench")
