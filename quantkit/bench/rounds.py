"""Alternating rounds, as the one-process benchmarks time two or more variants: the order of a round, and what
the per-round ratios say.

These machines drift (docs/BENCHMARKS.md: whole stretches at one core's speed), so variants run in alternation and
each round's ratio counts. Every other round runs them in reverse, so that no variant always runs first (its place in
a round is then not tied to it, whatever the machine does between runs). Reversal leaves the middle one of three or
more in the middle every round; rotated_order moves each variant through every place in turn.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(runs: Sequence[T], r: int) -> list[T]:
    """The runs of round r: in order on even rounds, reversed on odd ones."""
    return list(runs) if r % 2 == 0 else list(runs)[::-1]


def rotated_order(runs: Sequence[T], r: int) -> list[T]:
    """The runs of round r: rotated r places, so that over len(runs) rounds each run stands once in every place."""
    k = r % len(runs) if runs else 0
    return list(runs[k:]) + list(runs[:k])


def alternate(runs: Mapping[T, Callable[[], float]], rounds: int,
              order: Callable[[Sequence[T], int], list[T]] = round_order) -> dict[T, list[float]]:
    """Each variant's results, one a round: every round runs each variant once, in `order`'s order (round_order's,
    or rotated_order's)."""
    results: dict[T, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in order(list(runs), r):
            results[name].append(runs[name]())
    return results


def per_round(rates: Sequence[float], base: Sequence[float]) -> str:
    """The median of each round's ratio rates[i] / base[i], and from 4 rounds on their quartiles: how far the
    ratio moves from round to round, which a median alone hides."""
    ratios = [r / b for r, b in zip(rates, base)]
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        text += f", quartiles {q1:.2f}-{q3:.2f}x"
    return text


def add_round_options(ap, rounds: int, threads: int) -> None:
    """--rounds and --threads, as a one-process benchmark that alternates its variants takes them."""
    ap.add_argument("--rounds", type=int, default=rounds, help="alternating rounds, every variant once a round")
    ap.add_argument("--threads", type=int, default=threads, help="torch threads")


def table_head(columns: Sequence[str]) -> str:
    """A markdown table's header and rule lines."""
    return "| " + " | ".join(columns) + " |\n" + "|" + "---|" * len(columns)


def median_row(key: object, times: Mapping[str, Sequence[float]], ratios: Sequence[tuple[str, str]],
               digits: int = 2) -> str:
    """A markdown table row of alternating rounds: `key`, each variant's median (in `times`' order), then for each
    (a, b) in `ratios` the median of the rounds' a / b."""
    cells = [str(key)] + [f"{statistics.median(t):.{digits}f}" for t in times.values()]
    cells += [f"{statistics.median(x / y for x, y in zip(times[a], times[b])):.2f}x" for a, b in ratios]
    return "| " + " | ".join(cells) + " |"
