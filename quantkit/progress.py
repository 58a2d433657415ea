"""Rich progress bars for long steps, on stderr (stdout stays clean for results)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

T = TypeVar("T")
_console = Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator:
    """Yields `advance(n=1)`; the bar is transient-free so the finished step stays visible."""
    if not enabled:
        yield lambda n=1: None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=_console) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


@contextmanager
def elapsed(description: str, enabled: bool = True) -> Iterator[None]:
    """A step of unknown length (a compile): its description and the time it has taken so far, on stderr."""
    if not enabled:
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
                  console=_console) as progress:
        progress.add_task(description, total=None)
        yield


def track(items: Iterable[T], description: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    items = list(items) if total is None else items
    with progress_bar(description, total if total is not None else len(items), enabled) as advance:
        for item in items:
            yield item
            advance()


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' own tqdm bars (e.g. "Writing model shards") off for the block, then as they were:
    our rich bars are the only ones a user sees."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
