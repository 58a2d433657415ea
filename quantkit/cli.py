"""The `quantkit` command line. Each command lives in quantkit/commands/<name>.py."""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "quantkit.commands.quantize",
    "quantkit.commands.generate",
    "quantkit.commands.check",
    "quantkit.commands.demo",
    "quantkit.commands.eval",
    "quantkit.commands.serve",
    "quantkit.commands.bench",
)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="quantkit",
        help="INT4 quantization for Hugging Face LLMs: quantize, check, eval, generate, serve.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_root)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def _root() -> None:
    """quantkit: quantize a Hugging Face checkpoint to INT4, check it, measure it, serve it."""


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
