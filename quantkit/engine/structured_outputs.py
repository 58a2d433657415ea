"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a grammar by a token mask at
every sampling step, from llguidance (the grammar engine of llama.cpp, and vLLM's alternative to xgrammar).

Why llguidance: on this project's CPU it compiled each test schema in 0.7-1.3 ms against xgrammar's 2.1-6.1 ms, and
masked a step of 8 sequences in 0.15-0.28 ms against 0.16-1.05 ms (`python benchmarks/grammar_engines.py`,
docs/BENCHMARKS.md); it also needs no other package (xgrammar pulls in Triton and TVM's FFI).

A spec (`StructuredOutputsParams`, vLLM's fields) compiles once per engine into a template matcher, checked at
`add_request` so that a schema the engine cannot compile is refused before it is queued; each sequence (each of
`n` samples too) takes a copy of the template. Before a step's sampling the rows of constrained sequences get
their mask (-inf on every token the grammar does not allow next); after it, each matcher consumes its token. The
matcher's state is the sequence's output so far, so preemption (recompute or swap) and prefix caching leave it
right. A sequence whose grammar is complete and has taken EOS finishes with finish_reason "stop".
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import torch

from quantkit.engine.sampling_params import StructuredOutputsParams
from quantkit.errors import QuantkitError

# JSON as json.dumps writes it: ", " and ": ", no other whitespace. With free whitespace (the JSON grammar's own), a
# small or quantized model given a schema can emit newlines forever: seen on stories260K-hf, greedy, 60 tokens of
# '{ \n"mood" \n \n ...' and no value.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# byte value -> its 8 bits, little-endian, as 0 (allowed) or -inf (forbidden): float32 [256, 8]
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The grammar engine's bitmask int32 [B, ceil(V / 32)] (bit j of word w: token 32 w + j allowed) -> an additive
    bias fp32 [B, V]: 0 where allowed, -inf where not. A table lookup per byte and an add, not a masked fill: torch's
    masked_fill and where ran 5-10x slower than an add on this CPU (256k elements: 2.2 ms against 0.2 ms). Not with
    llguidance.torch either: importing it imports torch's compiler (6 s here), and its mask kernel is a torch.compile
    one that compiles C++ on first use, which needs a compiler on the user's machine."""
    as_bytes = bitmask.numpy().view(np.uint8)  # [B, 4 W], little-endian words
    return torch.from_numpy(_BYTE_BIAS[as_bytes].reshape(as_bytes.shape[0], -1)[:, :vocab_size])


def fill_bitmask(matcher, row: torch.Tensor) -> None:
    """The matcher's next-token bitmask into `row` (int32 [W], contiguous, CPU), written in place by llguidance."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec` (not yet checked against a tokenizer)."""
    import llguidance

    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_LAYOUT)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or llama.cpp's GBNF
    except ValueError as exc:
        raise QuantkitError(f"structured outputs: {spec.kind}: {exc}") from None


class GrammarMatchers:
    """The engine's grammars: compiled specs (cached) and one matcher per constrained sequence."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self._hf_tokenizer, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None  # llguidance's view of the vocabulary: ~1 s to build, so only when first asked
        self._templates: dict[StructuredOutputsParams, object] = {}
        self._matchers: dict[str, object] = {}

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            if not self.eos_ids:
                raise QuantkitError("structured outputs need an EOS token, and this model's tokenizer has none")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_ids)
            except ValueError as exc:  # a slow (Python) tokenizer
                raise QuantkitError(f"structured outputs need a fast tokenizer: {exc}") from None
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams):
        """The template matcher of `spec`, compiled once; QuantkitError naming the problem where it does not compile."""
        template = self._templates.get(spec)
        if template is None:
            import llguidance

            tokenizer = self._llg_tokenizer()
            grammar = grammar_text(spec)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise QuantkitError(f"structured outputs: the {spec.kind} does not compile: "
                                    f"{' '.join(error.split())}")
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise QuantkitError(f"structured outputs: the {spec.kind} does not compile: {template.get_error()}")
            self._templates[spec] = template
        return template

    def _matcher(self, request_id: str, spec: StructuredOutputsParams):
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = self.compile(spec).deep_copy()
        return matcher

    def masked(self, logits: torch.Tensor, request_ids: Sequence[str],
               specs: Sequence[StructuredOutputsParams | None]) -> torch.Tensor:
        """logits [B, V] -> fp32 CPU logits with every constrained row's disallowed tokens at -inf (a copy where any
        row is constrained; the input itself otherwise)."""
        rows = [i for i, spec in enumerate(specs) if spec is not None]
        if not rows:
            return logits
        out = logits.float().cpu().clone()
        bitmask = torch.empty(len(rows), -(-out.shape[-1] // 32), dtype=torch.int32)
        for j, i in enumerate(rows):
            fill_bitmask(self._matcher(request_ids[i], specs[i]), bitmask[j])
        out[rows] += mask_bias(bitmask, out.shape[-1])
        return out

    def accept(self, request_ids: Sequence[str], specs: Sequence[StructuredOutputsParams | None],
               tokens: Sequence[int]) -> None:
        """Each constrained sequence's matcher consumes its sampled token."""
        for rid, spec, token in zip(request_ids, specs, tokens):
            if spec is not None:
                matcher = self._matcher(rid, spec)
                if not matcher.consume_token(token):
                    raise RuntimeError(f"structured outputs: token {token} broke the grammar: {matcher.get_error()}")

    def finished(self, request_id: str) -> bool:
        """Whether the sequence's grammar is complete and has taken its EOS (nothing may follow)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_stopped()

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
