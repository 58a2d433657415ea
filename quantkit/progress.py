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


class Bar:
    """What `progress_bar` yields: `bar(n=1)` advances it, `bar.describe(text)` names the part under way (a step of
    its own inside the bar, such as a model loading). A Bar() of its own does nothing: the default where a caller
    shows no progress."""

    def __init__(self, progress: Progress | None = None, task=None):
        self._progress, self._task = progress, task

    def __call__(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator[Bar]:
    """Yields a Bar (call it to advance); the bar is transient-free so the finished step stays visible."""
    if not enabled:
        yield Bar()
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=_console) as progress:
        yield Bar(progress, progress.add_task(description, total=total))


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


# lm-eval's modules that show tqdm bars on our path (building a task's contexts, checking cached requests); each
# bound `tqdm` at its own import.
LM_EVAL_TQDM_MODULES = ("lm_eval.api.task", "lm_eval.api.model")


@contextmanager
def no_lm_eval_bars() -> Iterator[None]:
    """lm-eval's tqdm bars off for the block, then as they were: our rich bars are the only ones a user sees.
    TQDM_DISABLE cannot do it once tqdm is imported (torch imports it; tqdm reads its environment at import),
    and lm-eval offers no switch for these bars, so the block swaps the name those modules call."""
    import importlib
    from functools import partial

    modules = [importlib.import_module(name) for name in LM_EVAL_TQDM_MODULES]
    saved = [module.tqdm for module in modules]
    for module, bar in zip(modules, saved):
        module.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        for module, bar in zip(modules, saved):
            module.tqdm = bar
