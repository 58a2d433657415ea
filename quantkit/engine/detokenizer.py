"""Incremental detokenization that never splits a multi-byte character, and stop-string cutting.

Each step decodes a short window of ids twice (up to the last emitted token, and through the
new one) and emits the difference, in the manner of vLLM's offsets. A window whose text ends in
U+FFFD is an incomplete UTF-8 sequence (a byte-fallback token): nothing is emitted until the
character completes. Starting the window inside the prompt keeps SentencePiece's leading-space
rule from eating the first output space. An id past the tokenizer's vocabulary (a model whose embedding is
padded beyond it, or a random test model) decodes to no text anywhere in a window, so it never enters one:
otherwise the window could not advance past it, and every later decode would cover all the output since.
"""

from __future__ import annotations

from collections.abc import Sequence

PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # honoured by slow (Python) tokenizers; fast ones accept and ignore it, as in vLLM
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.known_ids = len(tokenizer)  # ids from here on are not the tokenizer's

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new complete text (possibly empty)."""
        if token_id >= self.known_ids:  # no text of its own, none added to its neighbours'
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, delta_len: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that the last `delta_len` characters completed: (its start, it)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
