"""The `quantkit` command line. Each command lives in quantkit/commands/<name>.py.

A command module imports only typer and quantkit.commands.common at its top; the library it
calls (torch, transformers, the engine) is imported inside the command, so `quantkit --help`
stays fast.
"""

from __future__ import annotations

import typer

from quantkit.commands import bench, check, demo, env, generate, plan, quantize, serve
from quantkit.commands import eval as eval_command

COMMANDS = (quantize, generate, check, demo, eval_command, plan, serve, bench, env)  # the order of `quantkit --help`


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="quantkit",
        help="INT4 quantization for Hugging Face LLMs: quantize, check, eval, generate, serve.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_root)
    for command in COMMANDS:
        command.register(app)
    return app


def _root() -> None:
    """quantkit: quantize a Hugging Face checkpoint to INT4, check it, measure it, serve it."""


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
