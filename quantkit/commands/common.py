"""Shared CLI plumbing: one-line errors, the console, and run-in-a-temp-folder-then-rename."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from quantkit.errors import QuantkitError

console = Console(stderr=True)


def cpu_int8_activations_option(make: Callable = typer.Option):
    """`--cpu-int8-activations` of generate and serve (EngineConfig.cpu_int8_activations); `make`: typer.Option, or
    flags.option for a field of a flags dataclass."""
    return make(False, "--cpu-int8-activations/--no-cpu-int8-activations",
                        help="CPU, bf16, 4-bit checkpoints: the 4-bit linears round activations to int8 per row and "
                             "group (W4A8 on AVX-512 VNNI, as llama.cpp), prefill too except on AMX CPUs. Off: W4A16, "
                             "the checkpoint's arithmetic.")


def cpu_int8_prefill_option(make: Callable = typer.Option):
    """`--cpu-int8-prefill` of generate and serve (EngineConfig.cpu_int8_prefill); `make` as above."""
    return make(None, "--cpu-int8-prefill/--no-cpu-int8-prefill", show_default=False,
                        help="CPU, bf16, 4-bit checkpoints: prompt tokens run W4A8 (activations rounded to int8 per row "
                             "and group, about 1.5x the prefill speed), generated tokens W4A16. Default: on where the "
                             "int8 kernel builds and the CPU has no AMX. Off: W4A16 throughout.")


def cpu_int8_lm_head_option(make: Callable = typer.Option):
    """`--cpu-int8-lm-head` of generate and serve (EngineConfig.cpu_int8_lm_head); `make` as above."""
    return make(None, "--cpu-int8-lm-head/--no-cpu-int8-lm-head", show_default=False,
                        help="CPU, bf16, AVX-512 VNNI: hold a float lm_head in int8 (symmetric, groups of 128, as "
                             "llama.cpp's Q8_0): half the bytes each decode step reads for it. Default: on for "
                             "quantized checkpoints, off for float ones. Off: the checkpoint's float head.")


def one_line_errors(fn: Callable) -> Callable:
    """Turn QuantkitError into 'error: ...' on stderr and exit 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QuantkitError as exc:
            console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]: nothing was written")
            raise typer.Exit(130) from None

    return wrapper


def prepare_output_dir(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise QuantkitError(f"{out}: already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"{out}: exists and is not a folder")


@contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any failure it is removed."""
    prepare_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
