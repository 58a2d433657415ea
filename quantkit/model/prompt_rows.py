"""Which rows of the current forward are prompt tokens, for the linears that run them through another kernel.

The engine's `cpu_int8_prefill` runs prompt tokens through the W4A8 kernel (activations rounded to int8 per row and
group: the arithmetic of llama.cpp's Q4 types, about twice the multiply rate of bf16 on CPUs without AMX) and the
tokens it generates through the W4A16 one. A step's forward is one flat batch in which prompt chunks and decodes may
sit side by side, so the runner says, for the length of the forward, which rows are whose (`prompt_rows`); a linear
whose input has exactly the step's rows (not an MoE expert's share, not the sampled rows of a head) splits there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptRows:
    """The step's `total` rows: `prompt` the prompt tokens' row indices and `others` the rest (int64), or both None
    when every row is a prompt token."""

    total: int
    prompt: torch.Tensor | None = None
    others: torch.Tensor | None = None

    @classmethod
    def of_spans(cls, spans: Sequence[tuple[int, bool]]) -> PromptRows | None:
        """From the step's chunks in order, each (rows, whether a prompt chunk); None when no row is a prompt's."""
        total = sum(n for n, _ in spans)
        if not any(is_prompt and n for n, is_prompt in spans):
            return None
        if all(is_prompt for n, is_prompt in spans if n):
            return cls(total)
        mask = torch.cat([torch.full((n,), is_prompt, dtype=torch.bool) for n, is_prompt in spans])
        return cls(total, mask.nonzero().squeeze(1), (~mask).nonzero().squeeze(1))

    @property
    def every(self) -> bool:
        return self.prompt is None


_CURRENT: ContextVar[PromptRows | None] = ContextVar("quantkit_prompt_rows", default=None)


@contextmanager
def prompt_rows(rows: PromptRows | None) -> Iterator[None]:
    """`rows` are the current forward's for the length of the block."""
    token = _CURRENT.set(rows)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> PromptRows | None:
    return _CURRENT.get()
