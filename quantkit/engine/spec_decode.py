"""Speculative decoding by n-gram prompt lookup (vLLM's `{"method": "ngram"}`): the pure parts.

A sequence's next tokens are guessed from its own past: the longest suffix of its tokens (at most
`prompt_lookup_max`, at least `prompt_lookup_min`) that occurred before is looked up, and the tokens that followed its
latest earlier occurrence are the draft (at most `num_speculative_tokens`). The engine runs the last known token and
the K drafts as one chunk of K + 1 positions, so one forward gives the target's distribution at each; `verify` then
keeps the drafts the target agrees with and adds one token of its own:
  greedy    drafts are kept while each equals the argmax of the target's processed logits; the first that differs
            is replaced by that argmax (so the output is token for token the output without speculation);
  sampling  rejection sampling with a deterministic draft (q puts all its mass on the draft token d): d is kept with
            probability p(d), else a token is drawn from p with d removed and renormalised, which is p's distribution
            exactly; after K kept drafts one more token is drawn from the last position's p.
Processing (penalties, min_tokens, temperature, top-k/p, min-p) at position j sees the kept drafts before j as
output, as it would have without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError


DEFAULT_LOOKUP = 5  # vLLM's n-gram window when the config gives neither bound


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for the n-gram method. The lookup window's bounds default as vLLM's do: one
    given, the other equals it; neither, both 5. A window of one token drafts after any repeated token, most of
    which the target rejects: each rejected draft costs a verified position."""

    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    method: str = "ngram"

    def __post_init__(self):
        if self.method not in ("ngram", "[ngram]"):
            raise QuantkitError(f"speculative decoding: method {self.method!r} is not supported (only \"ngram\": "
                                "prompt lookup; a draft model needs a second model, which the CPU engine does not run)")
        if self.num_speculative_tokens < 1:
            raise QuantkitError("speculative decoding: num_speculative_tokens must be at least 1")
        n_max, n_min = self.prompt_lookup_max, self.prompt_lookup_min
        if n_max is None and n_min is None:
            n_max = n_min = DEFAULT_LOOKUP
        n_max, n_min = (n_min if n_max is None else n_max), (n_max if n_min is None else n_min)
        object.__setattr__(self, "prompt_lookup_max", n_max)
        object.__setattr__(self, "prompt_lookup_min", n_min)
        if not 1 <= n_min <= n_max:
            raise QuantkitError("speculative decoding: need 1 <= prompt_lookup_min <= prompt_lookup_max "
                                f"(got {n_min}, {n_max})")

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise QuantkitError(f"speculative decoding: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "num_speculative_tokens" not in d:
            raise QuantkitError("speculative decoding: num_speculative_tokens is required")
        return cls(**{k: d[k] for k in d})


def propose_ngram(tokens: Sequence[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram of `tokens`
    (n from n_max down to n_min); [] when no suffix recurs."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):  # latest occurrence first, never the suffix itself
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []


class NgramIndex:
    """The drafts of `propose_ngram` for one growing token list at a constant cost a step: the latest start of every
    n-gram (n from n_min to n_max) but the list's own suffix, kept in one table per n and extended by the tokens
    appended since the last call (the scan of the whole list per step cost 4% of a small model's decode)."""

    def __init__(self, n_max: int, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self._reset()

    def _reset(self) -> None:
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.next_start = dict.fromkeys(self.latest, 0)
        self.length = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        length = len(tokens)
        if length < self.length:  # the list shrank: it is another list now
            self._reset()
        self.length = length
        if k <= 0 or length < 2:
            return []
        for n, table in self.latest.items():  # index every start up to length - n - 1: all but the suffix
            for start in range(self.next_start[n], length - n):
                table[tuple(tokens[start:start + n])] = start
            self.next_start[n] = max(self.next_start[n], length - n)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.latest[n].get(tuple(tokens[length - n:]))
            if start is not None:
                return list(tokens[start + n:start + n + k])
        return []


def verify_greedy(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Greedy verification: `target` holds the argmax at each of the K + 1 positions; the kept drafts, then the
    target's own token (the first disagreement, or the bonus after all K)."""
    out = []
    for j, d in enumerate(drafts):
        if target[j] != d:
            out.append(target[j])
            return out
        out.append(d)
    out.append(target[len(drafts)])
    return out


def accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator | None) -> tuple[int, bool]:
    """Rejection sampling of a deterministic draft against target probabilities probs [V] (sum 1): (the draft, True)
    with probability probs[draft]; else (a token from probs without the draft, renormalised, False)."""
    p_draft = float(probs[draft])
    u = float(torch.rand((), generator=generator))
    if u < p_draft:
        return draft, True
    residual = probs.clone()
    residual[draft] = 0.0
    total = float(residual.sum())
    if total <= 0.0:  # all the mass was on the draft (rounding): it stands
        return draft, True
    return int(torch.multinomial(residual / total, 1, generator=generator)), False
