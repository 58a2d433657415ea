"""Log-probabilities of sampled (or prompt) tokens and their top alternatives, from the raw logits
(before penalties and temperature: vLLM's default "raw_logprobs")."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from quantkit.engine.request import Logprob
from quantkit.errors import QuantkitError


ROWS_PER_PASS = 256  # bounds the [rows, vocab] temporaries of a long prompt's logprobs


def logprob_dicts(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int],
                  decode: Callable[[int], str]) -> list[dict[int, Logprob]]:
    """logits [R, V] -> per row {token: Logprob, then the top num_top[r] alternatives}.

    A token's rank is 1 + the number of tokens with a strictly higher log-probability."""
    out: list[dict[int, Logprob]] = []
    for i in range(0, len(token_ids), ROWS_PER_PASS):
        j = i + ROWS_PER_PASS
        out += _logprob_dicts(logits[i:j], token_ids[i:j], num_top[i:j], decode)
    return out


def _logprob_dicts(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int],
                   decode: Callable[[int], str]) -> list[dict[int, Logprob]]:
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V] fp32
    chosen_ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, chosen_ids[:, None])[:, 0]  # [R]
    ranks = ((lp > chosen[:, None]).sum(dim=1) + 1).tolist()
    k = max(num_top)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()
    out = []
    for r, tok in enumerate(token_ids):
        d = {tok: Logprob(chosen[r], ranks[r], decode(tok))}
        for j in range(num_top[r]):
            d.setdefault(top_i[r][j], Logprob(top_v[r][j], j + 1, decode(top_i[r][j])))
        out.append(d)
    return out


def check_logprobs_limit(logprobs: int | None, prompt_logprobs: int | None, limit: int, vocab: int) -> None:
    """A request's logprobs against the engine's --max-logprobs (-1: the vocabulary; never past it), in vLLM's
    words; QuantkitError (a server's 400) when above."""
    limit = vocab if limit == -1 else min(limit, vocab)
    for what, value in (("sample", logprobs), ("prompt", prompt_logprobs)):
        if value is not None and value > limit:
            raise QuantkitError(f"Requested {what} logprobs of {value}, which is greater than max allowed: {limit} "
                                "(--max-logprobs)")
