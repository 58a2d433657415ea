"""The tokenizer from two threads: HF fast tokenizers raise "Already borrowed" when two threads use one
at once. The engine thread owns the engine's tokenizer (detokenization, logprob texts); the event loop
(/tokenize, /detokenize, prompts, echo) uses its own copy. Hammered at once, nothing fails, and each
tokenizer is only ever touched by its own thread."""

from __future__ import annotations

import asyncio
import threading

import httpx

from quantkit.model.loader import load_tokenizer
from tests_support.serving import serve_in_thread, settings_for

TEXTS = [f"Once upon a time {i} there was a little girl named Lily. " * (1 + i % 7) for i in range(40)]


class ThreadRecorder:
    """A tokenizer that notes every thread that uses it."""

    def __init__(self, tokenizer):
        self._tok, self.threads = tokenizer, set()

    def _seen(self):
        self.threads.add(threading.get_ident())
        return self._tok

    def __getattr__(self, name):
        return getattr(self._seen(), name)

    def __call__(self, *args, **kwargs):
        return self._seen()(*args, **kwargs)

    def __len__(self):
        return len(self._seen())


async def hammer(url: str) -> list[tuple[str, int, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def tokenize(text):
            r = await c.post("/tokenize", json={"prompt": text})
            return "tokenize", r.status_code, r.json()

        async def detokenize(ids):
            r = await c.post("/detokenize", json={"tokens": ids})
            return "detokenize", r.status_code, r.json()

        async def stream(text):
            body = {"prompt": text, "max_tokens": 16, "ignore_eos": True, "stream": True, "logprobs": 2}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return "stream", r.status_code, lines

        jobs = [tokenize(t) for t in TEXTS] + [detokenize(list(range(3, 3 + 20 * (1 + i % 9)))) for i in range(40)]
        jobs += [stream(t) for t in TEXTS[:24]]
        return await asyncio.gather(*jobs)


def test_tokenize_detokenize_and_streaming_at_once(stories_dir):
    reference = load_tokenizer(stories_dir)
    with serve_in_thread(settings_for(stories_dir, max_num_seqs=32)) as srv:
        engine_tok = srv.engine.tokenizer = ThreadRecorder(srv.engine.tokenizer)
        front_tok = srv.state.llm.tokenizer = ThreadRecorder(srv.state.llm.tokenizer)
        results = asyncio.run(hammer(srv.url))
        srv.wait_idle()
    assert [status for _, status, _ in results if status != 200] == []
    tokenized = [body["tokens"] for kind, _, body in results if kind == "tokenize"]
    assert tokenized == [reference(t).input_ids for t in TEXTS]
    detok = [body["prompt"] for kind, _, body in results if kind == "detokenize"]
    assert detok == [reference.decode(list(range(3, 3 + 20 * (1 + i % 9)))) for i in range(40)]
    assert all(lines[-1] == "data: [DONE]" for kind, _, lines in results if kind == "stream")
    # one owner each: the engine thread detokenized, the event loop tokenized; never the other's
    assert len(engine_tok.threads) == 1 and len(front_tok.threads) == 1
    assert engine_tok.threads != front_tok.threads
