"""A command's flags as one typed dataclass: each field carries its Typer option, and `command` turns the dataclass
into the Typer command that parses them (so a long flag list is data, not a function signature).

    @dataclass(frozen=True)
    class ServeFlags:
        model: str = argument(..., help="...")
        port: int = option(8000, "--port")

    app.command("serve")(command(ServeFlags, run))   # run(ctx, flags: ServeFlags)

Typer reads the signature `command` writes (ctx, then the fields in order, each with its option as default), so
the help, the flag names, their order and the parsing are what the same parameters written out would give.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import typer

_CLI = "cli"  # the field metadata key holding its typer.Option / typer.Argument


def option(default: Any, *names: str, **kwargs) -> Any:
    """A dataclass field that is the flag `names` (typer.Option's arguments)."""
    return dataclasses.field(default=None if default is ... else default,
                             metadata={_CLI: typer.Option(default, *names, **kwargs)})


def argument(default: Any, **kwargs) -> Any:
    """A dataclass field that is a positional argument (typer.Argument's arguments)."""
    return dataclasses.field(default=None if default is ... else default,
                             metadata={_CLI: typer.Argument(default, **kwargs)})


def given_flags(ctx: typer.Context) -> frozenset[str]:
    """The names of the parameters the command line gave (not left at their defaults)."""
    return frozenset(name for name in ctx.params if ctx.get_parameter_source(name).name != "DEFAULT")


def command(flags_type: type, run: Callable[[typer.Context, Any], None]) -> Callable[..., None]:
    """A Typer command: its parameters are `flags_type`'s fields; it calls run(ctx, flags_type(**values)). Its help is
    run's docstring."""
    hints = typing.get_type_hints(flags_type)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.metadata[_CLI],
                                 annotation=hints[f.name]) for f in dataclasses.fields(flags_type)]

    @functools.wraps(run)
    def parse(ctx: typer.Context, **values) -> None:
        return run(ctx, flags_type(**values))

    del parse.__wrapped__  # Typer reads the signature below, not run's
    parse.__signature__ = inspect.Signature(params, return_annotation=None)
    parse.__annotations__ = {p.name: p.annotation for p in params}
    return parse
