"""The sampler: pure functions over logits, and a per-request generator for reproducible seeds.

Order, as in vLLM: min-tokens (EOS and stop ids masked), repetition penalty (prompt and output),
presence/frequency penalties (output only), temperature, top-k, top-p, min-p, then a draw. Greedy
rows (temperature 0) take the argmax of the penalised logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.spec_decode import accept_or_resample
from quantkit.kernels.cpu_fused import argmax_rows


def apply_repetition_penalty(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """logits [V] fp32; the HF rule: positive logits of seen tokens divided by `penalty`, negative multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(set(seen)), dtype=torch.int64, device=logits.device)
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_presence_frequency(logits: torch.Tensor, output: Sequence[int], presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties over the output tokens so far: logit -= presence * [count > 0] + frequency * count."""
    if (presence == 0.0 and frequency == 0.0) or not output:
        return logits
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1])
    counts = counts[:logits.shape[-1]].to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's logit_bias: each (token id, bias) added to that token's logit [V]; ids outside the vocabulary are
    skipped (the server refuses them; the padded rows of a model's head may lie past the tokenizer's)."""
    pairs = [(t, b) for t, b in bias if 0 <= t < logits.shape[-1]]
    if not pairs:
        return logits
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
    return logits.index_add(0, ids, torch.tensor([b for _, b in pairs], dtype=logits.dtype))


def mask_tokens(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """Set the logits of `token_ids` to -inf (min_tokens: no EOS or stop token yet); ids outside the
    vocabulary (a user's stop_token_ids) are ignored rather than failing the whole step."""
    ids = sorted(t for t in token_ids if 0 <= t < logits.shape[-1])
    if not ids:
        return logits
    return logits.index_fill(0, torch.tensor(ids, dtype=torch.int64), float("-inf"))


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


def processed_logits(logits: torch.Tensor, params: SamplingParams, seen: Sequence[int], output: Sequence[int] = (),
                     banned: Sequence[int] = ()) -> torch.Tensor:
    """logits [V] fp32 as the draw sees them: masks and penalties, then (unless greedy) temperature, top-k, top-p and
    min-p. `seen`: prompt and output ids; `output`: the output ids; `banned`: ids masked out (EOS and stop ids
    while min_tokens is not reached). logit_bias comes first, as OpenAI adds it to the model's logits."""
    logits = mask_tokens(apply_logit_bias(logits, params.logit_bias), banned)
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = apply_presence_frequency(logits, output, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return logits
    # an extreme penalty or temperature (1e-308 is a valid float) overflows to +inf, and softmax of inf - inf is
    # nan: the largest finite value keeps those tokens the likeliest (-inf, a masked token, stays masked)
    logits = (logits / params.temperature).nan_to_num(posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    return apply_min_p(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), params.min_p)


def sample_row(logits: torch.Tensor, params: SamplingParams, seen: Sequence[int],
               generator: torch.Generator | None, output: Sequence[int] = (),
               banned: Sequence[int] = ()) -> int:
    """One token id from logits [V] fp32 (see processed_logits)."""
    logits = processed_logits(logits, params, seen, output, banned)
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


class Sampler:
    """Holds one CPU generator per sampling request: seeded from its seed, or from the engine's seed."""

    def __init__(self, seed: int = 0, eos_ids: frozenset[int] = frozenset()):
        self.eos_ids = eos_ids
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

    def banned_ids(self, params: SamplingParams, num_output: int) -> tuple[int, ...]:
        """Ids that may not be sampled yet: EOS (unless ignored) and stop ids before min_tokens."""
        if num_output >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_ids)
        return tuple(set(eos) | set(params.stop_token_ids))

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
               histories: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]] | None = None) -> list[int]:
        """logits [B, V] fp32 -> B token ids. `histories`: prompt + output ids; `outputs`: output ids
        (for presence/frequency penalties and min_tokens). Plain greedy rows share one argmax."""
        logits = logits.float().cpu()
        out = argmax_rows(logits).tolist()
        outputs = outputs if outputs is not None else [()] * len(params)
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            banned = self.banned_ids(p, len(outputs[i]))
            if p.greedy and not p.has_penalties and not banned and not p.logit_bias:
                continue
            gen = None if p.greedy else self.generator(rid, p)
            out[i] = sample_row(logits[i], p, histories[i], gen, outputs[i], banned)
        return out

    def verify(self, logits: torch.Tensor, request_id: str, params: SamplingParams, history: Sequence[int],
               output: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """Speculative decoding's verification (quantkit.engine.spec_decode): logits [K + 1, V] at the last known
        token and each of the K drafts -> the kept drafts and one token of the target's. Position j is processed
        with the kept drafts before it as output."""
        logits = logits.float().cpu()
        gen = None if params.greedy else self.generator(request_id, params)
        kept: list[int] = []
        for j in range(len(drafts) + 1):
            banned = self.banned_ids(params, len(output) + len(kept))
            row = processed_logits(logits[j], params, [*history, *kept], [*output, *kept], banned)
            if j == len(drafts):  # every draft kept: the bonus token
                kept.append(int(row.argmax()) if params.greedy else
                            int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)))
                break
            if params.greedy:
                token = int(row.argmax())
                ok = token == drafts[j]
            else:
                token, ok = accept_or_resample(torch.softmax(row, dim=-1), drafts[j], gen)
            kept.append(token)
            if not ok:
                break
        return kept
