"""Which grammar engine masks quantkit's logits for structured outputs: xgrammar (vLLM's default) or llguidance
(llama.cpp's, and vLLM's alternative). The question of issue 37; the answer is in docs/BENCHMARKS.md.

    python benchmarks/grammar_engines.py [--steps 64] [--batch 1,8] [--threads 2]

Tokenizer: a byte-level BPE trained here on WikiText-2 (valid + test; 26k tokens: no real tokenizer can be
downloaded on this machine). For each JSON schema below and each engine: the compile time (cold: a new compiler, no
cache), then decoding as a sampler drives it: at each step, fill the next-token bitmask of every sequence of the
batch, apply it to random logits, take the argmax of what is allowed, and advance the matcher, for --steps steps or
until every sequence has finished. Reported: compile ms, and mask ms per step (fill + apply, the whole batch; the
median over steps). Both engines run in one process, alternating schema by schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2"

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["news", "sport", "science", "art"]}},
        "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["title", "tags", "author", "score"]},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
            "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
}


def wikitext_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train([str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int, threads: int):
        import xgrammar as xgr

        self.xgr, self.vocab, self.threads = xgr, vocab, threads
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        """The compiled grammar, and a first matcher made (as a request's first step would)."""
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema))
        self.matchers(compiled, 1)
        return compiled

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    @staticmethod
    def advance(m, token: int) -> bool:
        """Accept `token`; True while the sequence goes on."""
        m.accept_token(token)
        return not m.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt, self.vocab = llguidance, llguidance.torch, vocab
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        """The grammar, and a first matcher made: llguidance compiles a grammar when a matcher takes it."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.matchers(grammar, 1)
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers, bitmask):
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, list(zip(matchers, range(len(matchers)))), bitmask)

    def apply(self, logits, bitmask):
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    @staticmethod
    def advance(m, token: int) -> bool:
        m.consume_token(token)
        return not m.is_stopped()


def decode(engine, compiled, batch: int, steps: int, vocab: int, seed: int) -> list[float]:
    """ms per step (fill + apply over the live sequences), driving each sequence by the argmax of masked logits."""
    gen = torch.Generator().manual_seed(seed)
    matchers = engine.matchers(compiled, batch)
    live = list(range(batch))
    times = []
    bitmask = engine.bitmask(batch)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen)
        start = time.perf_counter()
        mask = bitmask[: len(live)]
        engine.fill([matchers[i] for i in live], mask)
        engine.apply(logits, mask)
        times.append((time.perf_counter() - start) * 1e3)
        tokens = logits.argmax(dim=-1).tolist()
        live = [i for i, t in zip(live, tokens) if engine.advance(matchers[i], t)]
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="compiles and decodes per schema and engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf = wikitext_tokenizer()
    vocab = len(hf)
    engines = [Xgrammar(hf, vocab, args.threads), Llguidance(hf, vocab, args.threads)]
    print(f"tokenizer: byte-level BPE on WikiText-2, {vocab} tokens; {args.threads} threads; {args.steps} steps")
    print("| schema | batch | engine | compile ms (median) | mask ms per step (median) | steps |")
    print("|---|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        for batch in (int(b) for b in args.batch.split(",")):
            rows = {e.name: ([], []) for e in engines}
            for r in range(args.repeats):
                for engine in (engines if r % 2 == 0 else engines[::-1]):
                    start = time.perf_counter()
                    compiled = engine.compile(schema)
                    rows[engine.name][0].append((time.perf_counter() - start) * 1e3)
                    rows[engine.name][1].extend(decode(engine, compiled, batch, args.steps, vocab, seed=r))
            for engine in engines:
                compile_ms, step_ms = rows[engine.name]
                print(f"| {name} | {batch} | {engine.name} | {statistics.median(compile_ms):.1f} | "
                      f"{statistics.median(step_ms):.3f} | {len(step_ms)} |", flush=True)


if __name__ == "__main__":
    main()
