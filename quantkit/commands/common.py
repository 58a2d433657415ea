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

from quantkit.commands.flags import option
from quantkit.errors import QuantkitError

console = Console(stderr=True)


# The CPU arithmetic switches that generate and serve share, EngineConfig's fields of the same names: each one's
# default (None: the engine decides) and help.
ENGINE_SWITCHES = {
    "cpu_int8_activations": (False, "CPU, 4-bit checkpoints: the 4-bit linears round activations to int8 per row "
                                    "and group (W4A8, as llama.cpp: AVX-512 VNNI in bf16, AVX2 in fp32), prefill too "
                                    "except on AMX CPUs. Off: W4A16, the checkpoint's arithmetic."),
    "cpu_int8_lm_head": (None, "CPU: hold a float lm_head in int8 (symmetric, groups of 128, as llama.cpp's Q8_0): "
                               "half the bytes each decode step reads for it in bf16, a quarter in fp32. Default: on for "
                               "quantized checkpoints, off for float ones. Off: the checkpoint's float head."),
    "cpu_int8_prefill": (None, "CPU, 4-bit checkpoints: prompt tokens run W4A8 (activations rounded to int8 per row "
                               "and group: faster prefill), generated tokens W4A16. Default: on where the int8 kernel "
                               "builds (fp32: every level; bf16: AVX-512 VNNI) and, in bf16, the CPU has no AMX. Off: "
                               "W4A16 throughout."),
    "cpu_huge_pages": (True, "CPU, Linux: move the weights into transparent huge pages once loaded and allocate the "
                             "KV cache there (where THP is not 'never'): decode reads both faster. Off: the "
                             "allocator's 4 KiB pages."),
}


def engine_switch(name: str):
    """The flags-dataclass field (quantkit.commands.flags.option) of ENGINE_SWITCHES[name]: --name/--no-name."""
    default, text = ENGINE_SWITCHES[name]
    flag = name.replace("_", "-")
    return option(default, f"--{flag}/--no-{flag}", show_default=default is not None, help=text)


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
