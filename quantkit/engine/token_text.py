"""A token's text in logprobs, written as vLLM writes it (vllm/tokenizers/detokenizer_utils.py and
vllm/v1/engine/logprobs.py, vLLM 0.32), so that clients see the same strings from either server.

Each token is decoded on its own, then:
  - a SentencePiece piece that starts with the Metaspace marker ("▁the") gets back the leading space that
    decode() strips from a sequence's first token (" the"): only for tokenizers whose pre-tokenizer is a
    Metaspace, as vLLM reads it from the tokenizer's JSON (a legacy Llama tokenizer, whose normalizer adds the
    marker, decodes "▁the" to "the" in vLLM too);
  - a text that ends in U+FFFD (a byte-fallback piece of a multi-byte character) is decoded again after up to
    4 tokens of its context (the tokens before it in the sequence); what the context completes is the text,
    and a piece that stays incomplete is "".
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from quantkit.engine.request import Logprob

REPLACEMENT = "\ufffd"
MAX_CONTEXT = 4  # tokens of context: enough for any UTF-8 sequence (at most 4 bytes)


def leading_space_marker(tokenizer) -> str | None:
    """The Metaspace replacement character of a fast tokenizer's pre-tokenizer ("▁"), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    candidates = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return next((p.get("replacement", "\u2581") for p in candidates if p.get("type") == "Metaspace"), None)


def restore_leading_spaces(raw_piece: str, text: str, marker: str) -> str:
    """`text` with the leading spaces back that its vocabulary piece `raw_piece` starts with (as markers)."""
    markers = len(raw_piece) - len(raw_piece.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


class TokenTexts:
    """Single-token texts of one tokenizer, cached (bounded by the vocabulary), and their correction in context.
    Used by the engine thread only (fast tokenizers are not thread-safe)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.marker = leading_space_marker(tokenizer)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            if self.marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens(token_id) or ""
                text = restore_leading_spaces(raw, text, self.marker)
            self._texts[token_id] = text
        return text

    def in_context(self, token_id: int, context: Sequence[int]) -> str:
        """The text of `token_id` after the tokens `context` (oldest first), for a text that ends in U+FFFD:
        what the shortest context that completes it adds, past the context's own complete text; "" if none does."""
        context = list(context)[-MAX_CONTEXT:]
        for k in range(1, len(context) + 1):
            tail = context[-k:]
            full = self.tokenizer.decode(tail + [token_id])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(tail)  # context tokens that are themselves incomplete belong to this token's text
            while clean > 0 and self.tokenizer.decode([tail[clean - 1]]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.tokenizer.decode(tail[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            return full[common:]
        return ""

    def correct(self, entries: dict[int, Logprob], context: Sequence[int]) -> dict[int, Logprob]:
        """One position's logprob entries with every text that ends in U+FFFD corrected in `context` (the
        sequence's tokens before this position), each alternative on its own."""
        if not any(lp.decoded_token and lp.decoded_token.endswith(REPLACEMENT) for lp in entries.values()):
            return entries
        return {t: lp if not (lp.decoded_token or "").endswith(REPLACEMENT)
                else Logprob(lp.logprob, lp.rank, self.in_context(t, context)) for t, lp in entries.items()}
