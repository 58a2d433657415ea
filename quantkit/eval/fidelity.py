"""How close a quantized model's next-token distribution stays to its float model's, on the perplexity windows.

Perplexity averages the log-prob of the one true token; two models with the same perplexity can still disagree on
the rest of the distribution. Per predicted position t (the `seqlen - 1` predictions of every window that
quantkit.eval.perplexity scores):

    KL_t   = sum_v p_float(v | t) * (log p_float(v | t) - log p_quant(v | t))     (nats; KL(float || quant))
    agree_t = argmax_v p_float(v | t) == argmax_v p_quant(v | t)

and the figures are their means over every position: the mean KL per token and the top-1 agreement. Both are 0 and
1 exactly for a model scored against itself.

The float model's log-probs are computed once (FloatReference) and reused for every quantized model: in memory up to
a byte budget, and the batches past it recomputed from the float model when they are needed, so the result is
exact either way and the memory stays bounded for large vocabularies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.eval.perplexity import logprob_nll, next_token_logprobs, window_batches
from quantkit.eval.windows import disjoint_windows

DEFAULT_BUDGET = 1 << 30  # bytes of float log-probs kept in memory (20k tokens x 1024 vocab in fp32: 80 MiB)


@dataclass(frozen=True)
class Fidelity:
    """One model scored against the float reference, on the same windows."""

    ppl: float
    kl: float  # mean KL(float || model) per prediction, nats
    top1: float  # fraction of predictions whose argmax is the float model's
    predictions: int

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "kl": self.kl, "top1": self.top1, "predictions": self.predictions}


def token_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || model) per position: log-probs [..., V] fp32 each -> [...]. Where ref's probability is 0 the term
    is 0 (the limit of p log p), never 0 * inf."""
    p = ref_logp.exp()
    return torch.where(p > 0, p * (ref_logp - logp), torch.zeros_like(p)).sum(-1)


def top1_matches(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Positions where the two argmaxes agree: [..., V] each -> [...] bool."""
    return ref_logp.argmax(-1) == logp.argmax(-1)


class FloatReference:
    """The float model's next-token log-probs over the windows of ids [n_tokens] (perplexity's windows and
    batches): each batch [B, seqlen - 1, V] fp32 kept while the kept ones fit in `budget_bytes`, the rest
    recomputed from `model` on demand (which is why the model is held)."""

    def __init__(self, model, ids: torch.Tensor, seqlen: int, batch_size: int = 4, budget_bytes: int = DEFAULT_BUDGET):
        spans = disjoint_windows(len(ids), seqlen)
        if not spans:
            raise QuantkitError(f"only {len(ids)} tokens, fewer than one window of {seqlen}")
        self.model, self.batches = model, window_batches(ids, spans, batch_size)
        self.predictions = len(spans) * (seqlen - 1)
        self._kept: list[torch.Tensor] = []
        nll, used = 0.0, 0
        for batch in self.batches:
            logp = self._forward(batch)
            nll += float(logprob_nll(logp, batch).sum())
            used += logp.numel() * logp.element_size()
            if used <= budget_bytes:  # `used` only grows: the kept batches are always the first ones
                self._kept.append(logp)
        self.ppl = math.exp(nll / self.predictions)

    @torch.no_grad()
    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        return next_token_logprobs(self.model(batch).logits)

    @property
    def kept(self) -> int:
        """How many batches are held in memory (the first ones); the others are recomputed."""
        return len(self._kept)

    def logprobs(self, i: int) -> torch.Tensor:
        """Batch i's float log-probs [B, seqlen - 1, V] fp32."""
        return self._kept[i] if i < len(self._kept) else self._forward(self.batches[i])


@torch.no_grad()
def score(model, ref: FloatReference) -> Fidelity:
    """`model`'s perplexity, mean KL(float || model) per prediction and top-1 agreement on ref's windows; its
    perplexity equals quantkit.eval.perplexity's on the same windows (the same batches, the same arithmetic)."""
    nll, kl, agree = 0.0, 0.0, 0
    for i, batch in enumerate(ref.batches):
        logp, ref_logp = next_token_logprobs(model(batch).logits), ref.logprobs(i)
        nll += float(logprob_nll(logp, batch).sum())
        kl += float(token_kl(ref_logp, logp).double().sum())
        agree += int(top1_matches(ref_logp, logp).sum())
    n = ref.predictions
    return Fidelity(math.exp(nll / n), kl / n, agree / n, n)
