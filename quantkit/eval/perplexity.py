"""Perplexity over non-overlapping windows, as the GPTQ and AWQ papers measure it.

Protocol: the whole text is tokenized once (with the tokenizer's default special tokens,
i.e. one BOS at the very start for Llama tokenizers and none between windows), cut into
`n_tokens // seqlen` windows of exactly `seqlen` tokens (the partial tail is dropped), and
each window is scored on its own: `seqlen - 1` next-token predictions per window.
ppl = exp(total NLL / total predictions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.eval.windows import disjoint_windows


@dataclass(frozen=True)
class PplProtocol:
    source: str  # the file, or "wikitext2" (wikitext-2-raw-v1 test from the hub)
    tokens: int  # tokens in the whole text
    windows: int
    seqlen: int
    predictions: int  # scored next-token predictions: windows * (seqlen - 1)
    bos: str  # how BOS was handled
    available: int | None = None  # the text's full windows when --limit scored only the first `windows`

    def describe(self) -> str:
        scored = f"{self.windows} non-overlapping windows of {self.seqlen}"
        if self.available is not None:
            scored = f"the first {self.windows} of {self.available} non-overlapping windows of {self.seqlen} (--limit)"
        return (f"{self.source}: {self.tokens} tokens, {scored} ({self.predictions} predictions, tail of "
                f"{self.tokens - self.available_windows * self.seqlen} dropped); {self.bos}")

    @property
    def available_windows(self) -> int:
        return self.windows if self.available is None else self.available


@dataclass(frozen=True)
class PplResult:
    ppl: float
    nll: float  # summed over all predictions, nats
    protocol: PplProtocol

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "protocol": asdict(self.protocol)}

    @classmethod
    def from_dict(cls, d: dict) -> PplResult:
        return cls(float(d["ppl"]), float(d["nll"]), PplProtocol(**d["protocol"]))


def tokenize_once(tokenizer, text: str) -> tuple[torch.Tensor, str]:
    """ids: [n_tokens] int64, and a note of the BOS handling."""
    # verbose=False: the text is cut into windows of the model's length, so the tokenizer's warning
    # about sequences longer than model_max_length does not apply
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]
    bos = tokenizer.bos_token_id
    note = ("one BOS at the start of the text, none per window" if bos is not None and len(ids) and ids[0] == bos
            else "no BOS added (the tokenizer adds none)")
    return ids, note


def next_token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] -> log-probs [B, T - 1, V] fp32 of the next token at each position but the last."""
    return F.log_softmax(logits[:, :-1].float(), dim=-1)


def logprob_nll(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL per window from next_token_logprobs: logp [B, T - 1, V], ids [B, T] -> [B] fp32."""
    return -logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL per window: logits [B, T, V], ids [B, T] -> [B] fp32 (T - 1 predictions each)."""
    return logprob_nll(next_token_logprobs(logits), ids)


def window_batches(ids: torch.Tensor, spans: list[tuple[int, int]], batch_size: int) -> list[torch.Tensor]:
    """The windows `spans` of ids [n_tokens], stacked `batch_size` at a time: [B, seqlen] int64 each."""
    return [torch.stack([ids[a:b] for a, b in spans[i:i + batch_size]]) for i in range(0, len(spans), batch_size)]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seqlen: int, source: str, bos_note: str, batch_size: int = 4,
               advance: Callable[[int], None] | None = None, device: str = "cpu",
               limit: int | None = None) -> PplResult:
    """Perplexity of `model` over the windows of ids [n_tokens]; `limit`: only the first that many windows
    (lm-eval's --limit: a quick check on a large test file)."""
    every = disjoint_windows(len(ids), seqlen)
    if not every:
        raise QuantkitError(f"{source}: only {len(ids)} tokens, fewer than one window of --seqlen {seqlen}")
    spans = every[:limit]
    total = 0.0
    for batch in window_batches(ids, spans, batch_size):
        batch = batch.to(device)
        total += float(window_nll(model(batch).logits, batch).sum())
        if advance is not None:
            advance(len(batch))
    predictions = len(spans) * (seqlen - 1)
    available = len(every) if len(spans) < len(every) else None
    protocol = PplProtocol(source, len(ids), len(spans), seqlen, predictions, bos_note, available)
    return PplResult(math.exp(total / predictions), total, protocol)


def read_ppl_text(source: str) -> str:
    """The text of a file, or wikitext-2-raw-v1's test split joined by blank lines (hub, when online)."""
    if source != "wikitext2":
        from pathlib import Path

        path = Path(source)
        if not path.is_file():
            raise QuantkitError(f"{source}: no such text file (--ppl-text)")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"{source}: unreadable text file ({exc})") from exc
    from quantkit.model.checkpoint import hub_offline

    if hub_offline():
        raise QuantkitError("wikitext2 comes from the Hugging Face hub, which is offline; pass --ppl-text FILE")
    import datasets

    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except (OSError, ValueError, ConnectionError) as exc:
        raise QuantkitError(f"could not load wikitext-2-raw-v1 from the hub ({type(exc).__name__}); "
                            "pass --ppl-text FILE") from exc
    return "\n\n".join(rows["text"])
