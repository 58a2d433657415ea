"""The sampler: pure functions over logits, and a per-request generator for reproducible seeds.

Order, as in vLLM: repetition penalty, temperature, top-k, top-p, min-p, then a draw. Greedy
rows (temperature 0) take the argmax of the penalised logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantkit.engine.sampling_params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """logits [V] fp32; the HF rule: positive logits of seen tokens divided by `penalty`, negative multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(set(seen)), dtype=torch.int64, device=logits.device)
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits [V] (ties at the k-th value kept), the rest -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    probs, order = torch.softmax(logits, dim=-1).sort(descending=True)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop = before >= p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, seen: Sequence[int],
               generator: torch.Generator | None) -> int:
    """One token id from logits [V] fp32."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    logits = apply_min_p(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), params.min_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Holds one CPU generator per sampling request: seeded from its seed, or from the engine's seed."""

    def __init__(self, seed: int = 0):
        self._engine_rng = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._engine_rng))
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
               histories: Sequence[Sequence[int]]) -> list[int]:
        """logits [B, V] fp32 -> B token ids. Plain greedy rows share one argmax."""
        logits = logits.float().cpu()
        out = logits.argmax(dim=-1).tolist()
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if p.greedy and p.repetition_penalty == 1.0:
                continue
            gen = None if p.greedy else self.generator(rid, p)
            out[i] = sample_row(logits[i], p, histories[i], gen)
        return out
