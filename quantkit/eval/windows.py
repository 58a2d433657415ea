"""Token windows for scoring: the pure arithmetic shared by the lm-eval backend and perplexity.

Nothing here touches a model; every function maps token lists to token lists or numbers,
so the tests can check the edges (truncation, the last partial window) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScoreWindow:
    """One (context, continuation) request as the model sees it.

    `inp` is what the model is fed: (context + continuation) minus its last token, cut from
    the left to at most `max_length` tokens, exactly as lm-eval's `hf` model does. The
    continuation's log-probs are read at the last `len(cont)` positions of `inp`.
    """

    inp: tuple[int, ...]
    cont: tuple[int, ...]
    truncated: bool


def score_window(context: list[int], continuation: list[int], max_length: int) -> ScoreWindow:
    if not context or not continuation:
        raise ValueError("context and continuation must both be non-empty token lists")
    if len(continuation) > max_length:
        raise ValueError(f"continuation of {len(continuation)} tokens exceeds the window of {max_length}")
    whole = context + continuation
    truncated = len(whole) > max_length + 1
    return ScoreWindow(tuple(whole[-(max_length + 1):][:-1]), tuple(continuation), truncated)


def batches_by_length(inputs: list[tuple[int, ...]], batch_size: int) -> list[list[tuple[int, ...]]]:
    """Longest first, so padding inside a batch stays small and memory peaks at the first batch."""
    ordered = sorted(inputs, key=lambda t: (-len(t), t))
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def disjoint_windows(n_tokens: int, seqlen: int) -> list[tuple[int, int]]:
    """[start, end) of the non-overlapping full windows over n_tokens; the partial tail is dropped.

    This is the GPTQ / AWQ perplexity protocol: `n_tokens // seqlen` windows of exactly seqlen
    tokens, each scored on its own (seqlen - 1 predictions per window).
    """
    if seqlen < 2:
        raise ValueError("seqlen must be at least 2")
    return [(i * seqlen, (i + 1) * seqlen) for i in range(n_tokens // seqlen)]
