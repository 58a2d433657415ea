"""`quantkit bench serve`: a client benchmark of any OpenAI-compatible server (ours or `vllm serve`).

Each request streams with `stream_options.include_usage`; the client records the time of every
token chunk. Per request: TTFT (first token chunk), ITL (gaps between token chunks), TPOT
((E2E - TTFT) / (output tokens - 1)), E2E. Arrivals are Poisson at --request-rate (inf: all at
once), at most --max-concurrency in flight. Random prompts have exactly --random-input-len tokens:
built from the server's /tokenize (or a local tokenizer) and sent as token ids to /v1/completions.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

WORDS = ("the a little girl boy dog cat tree house sun moon ran played saw big small happy sad friend park ball "
         "bird fish water sky day night mom dad said went found made good kind toy box red blue green").split()
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    num_prompts: int = 200
    request_rate: float = math.inf
    max_concurrency: int | None = None
    random_input_len: int = 256
    random_output_len: int = 128
    prompts: list[str] | None = None  # from --prompts-file; None: random prompts
    ignore_eos: bool = False
    api_key: str | None = None
    tokenizer: str | None = None  # a local tokenizer; None: the server's /tokenize
    seed: int = 0
    timeout: float = 600.0
    extra_body: dict | None = None  # more request fields, e.g. {"skip_special_tokens": False}

    def __post_init__(self):
        from quantkit.errors import QuantkitError

        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise QuantkitError(f"--endpoint {self.endpoint!r}: expected /v1/completions or /v1/chat/completions")
        if self.num_prompts < 1 or self.random_input_len < 1 or self.random_output_len < 1:
            raise QuantkitError("--num-prompts, --random-input-len and --random-output-len must be at least 1")
        if self.request_rate <= 0:
            raise QuantkitError(f"--request-rate must be > 0 (got {self.request_rate})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise QuantkitError(f"--max-concurrency must be at least 1 (got {self.max_concurrency})")


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def summarize(values: list[float]) -> dict[str, float]:
    """mean and percentiles in milliseconds, and how many values they summarize (empty input: zeros, as vLLM's
    bench writes them; `count` 0 tells them apart from measured zeros)."""
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "count": 0}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}, "count": len(a)}


def distinct_errors(results: list[RequestResult], most: int = 5) -> list[dict]:
    """The failed requests' messages, each once with how many requests failed with it, in order of first seen."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            message = r.error or "the stream ended before data: [DONE]"
            counts[message] = counts.get(message, 0) + 1
    return [{"message": m, "count": n} for m, n in list(counts.items())[:most]]


def report(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": cfg.model, "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "max_concurrency": cfg.max_concurrency, "duration_s": duration,
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": distinct_errors(results),
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": summarize([g for r in ok for g in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok]),
    }


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> tuple[str, int | None]:
    """(the model to ask for, its max_model_len where /v1/models gives one, as quantkit and vLLM do)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    models = r.json()["data"]
    entry = next((m for m in models if m["id"] == cfg.model), None) if cfg.model else models[0]
    return (cfg.model or entry["id"]), (entry or {}).get("max_model_len")


def check_lengths(cfg: BenchConfig, max_model_len: int | None) -> None:
    """Refuse lengths that the server would refuse on every request (prompt + max_tokens past its context)."""
    from quantkit.errors import QuantkitError

    if max_model_len is None:
        return
    where = f"the server's max_model_len of {max_model_len} (from /v1/models): every request would fail; lower them"
    if cfg.prompts is None and cfg.random_input_len + cfg.random_output_len > max_model_len:
        total = cfg.random_input_len + cfg.random_output_len
        raise QuantkitError(f"--random-input-len {cfg.random_input_len} + --random-output-len "
                            f"{cfg.random_output_len} = {total} tokens, past {where}")
    if cfg.prompts is not None and cfg.random_output_len >= max_model_len:
        raise QuantkitError(f"--random-output-len {cfg.random_output_len} leaves no room for a prompt within {where}")


async def random_prompts(client: httpx.AsyncClient, cfg: BenchConfig) -> list[list[int]]:
    """num_prompts lists of exactly random_input_len token ids (random words, tokenized, cut or repeated)."""
    rng = random.Random(cfg.seed)
    local = None
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        local = AutoTokenizer.from_pretrained(cfg.tokenizer)
    prompts = []
    for _ in range(cfg.num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(cfg.random_input_len))
        if local is not None:
            ids = local(text).input_ids
        else:
            r = await client.post("/tokenize", json={"model": cfg.model, "prompt": text})
            r.raise_for_status()
            ids = r.json()["tokens"]
        while len(ids) < cfg.random_input_len:
            ids = ids + ids
        prompts.append(ids[:cfg.random_input_len])
    return prompts


async def detokenize(client: httpx.AsyncClient, cfg: BenchConfig, ids: list[int]) -> str:
    r = await client.post("/detokenize", json={"model": cfg.model, "tokens": ids})
    r.raise_for_status()
    return r.json()["prompt"]


def request_body(cfg: BenchConfig, prompt: str | list[int]) -> dict:
    body = {"model": cfg.model, "max_tokens": cfg.random_output_len, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    body.update(cfg.extra_body or {})
    if cfg.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def is_token_chunk(obj: dict) -> bool:
    """A chunk that carries generated tokens: it has choices, and is not a chat stream's role opener.
    Its text may be empty (a token whose text the server holds back), so text alone would miss tokens."""
    choices = obj.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta")
    return not (delta is not None and "role" in delta and not delta.get("content"))


def error_message(body: bytes) -> str:
    """An error response's message: OpenAI's error.message where the body has one, else its first 200 bytes."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


async def one_request(client: httpx.AsyncClient, cfg: BenchConfig, prompt) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", cfg.endpoint, json=request_body(cfg, prompt)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {error_message(await r.aread())}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.ok = not res.error
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    continue
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if is_token_chunk(obj):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.ok = False
    res.e2e = time.perf_counter() - start
    return res


async def run(cfg: BenchConfig) -> dict:
    limits = httpx.Limits(max_connections=cfg.max_concurrency or cfg.num_prompts)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers(cfg.api_key), limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout)) as client:
        cfg.model, max_model_len = await resolve_model(client, cfg)
        check_lengths(cfg, max_model_len)
        if cfg.prompts is not None:
            prompts = [cfg.prompts[i % len(cfg.prompts)] for i in range(cfg.num_prompts)]
        else:
            prompts = await random_prompts(client, cfg)
            if cfg.endpoint == "/v1/chat/completions":
                prompts = [await detokenize(client, cfg, p) for p in prompts]
        gate = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
        rng = np.random.default_rng(cfg.seed)

        async def limited(p):
            async with gate:
                return await one_request(client, cfg, p)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(limited(p)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        results = await asyncio.gather(*tasks)
        return report(cfg, list(results), time.perf_counter() - start)


def table(rep: dict):
    from rich.table import Table

    t = Table(title=f"bench serve: {rep['base_url']}{rep['endpoint']} ({rep['model']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("successful_requests", "failed_requests", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput"):
        v = rep[key]
        t.add_row(key.replace("_", " "), f"{v:.2f}" if isinstance(v, float) else str(v))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        summary = dict(rep[key])
        count = summary.pop("count")
        for stat, v in summary.items():  # no sample (no request succeeded): "-", not a latency of 0.00
            t.add_row(f"{key[:-3].upper()} {stat} (ms)", f"{v:.2f}" if count else "-")
    return t


def failure_lines(rep: dict, max_failed: float) -> tuple[list[str], bool]:
    """What to say about failed requests (the count, then each distinct error), and whether they fail the run:
    more than `max_failed` (a share, 0..1) of the requests failed."""
    failed, total = rep["failed_requests"], rep["successful_requests"] + rep["failed_requests"]
    if not failed:
        return [], False
    lines = [f"{failed} of {total} requests failed" + (f" (more than --max-failed {max_failed:g})"
                                                         if failed > max_failed * total else "")]
    lines += [f"  {e['count']} x {e['message']}" for e in rep["errors"]]
    return lines, failed > max_failed * total
