"""Load with random disconnects on a real `quantkit serve` process: 200 concurrent streams, 20% of clients
leave at random points. No 5xx, every remaining stream ends with [DONE], no KV block held afterwards, and
the server's RSS flat once warm.

The server runs as its own process, so its RSS is its own (not the client's). Its first run fills the
per-shape kernel caches (oneDNN's and ideep's, capped by `quantkit serve`; see quantkit.memory) and the
allocator's arenas; after that a run must leave the RSS where it found it: a leak of per-request state
grows with every run."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from tests_support.serving import free_port, start_subprocess, wait_health

pytestmark = pytest.mark.slow
# Runs 0-3 warm up: the server's RSS grows for about five runs before it settles (bf16, quantkit's bf16 kernel: 484.8,
# 488.1, 491.9, 495.7, 500.6, 503.0, 504.0, 505.3, 505.3, 506.2, 506.6, 507.0 MiB after each of 12 runs; with oneDNN's
# linears it settled after two, docs/BENCHMARKS.md "Server memory under load").
NUM_REQUESTS, LEAVE_FRACTION, RUNS, WARM_UP = 200, 0.2, 8, 4
WARM_GROWTH_MIB = 4.0  # MiB per run, averaged over the warm runs: allocator noise stays below it; a leak grows past it


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def one(client: httpx.AsyncClient, i: int, leave_after: int | None) -> tuple[int, bool]:
    """(status, ended with [DONE]); a leaving client closes after `leave_after` data lines."""
    body = {"prompt": f"Once upon a time {i}", "max_tokens": 12, "ignore_eos": True, "stream": True,
            "temperature": 0.8, "seed": i}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, False
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return 200, True
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    return 200, False  # leaving: the context manager closes the connection
    return r.status_code, False


async def load_run(url: str, seed: int) -> list[tuple[int, bool, bool]]:
    rng = random.Random(seed)
    leavers = set(rng.sample(range(NUM_REQUESTS), int(NUM_REQUESTS * LEAVE_FRACTION)))
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        plans = [rng.randint(1, 10) if i in leavers else None for i in range(NUM_REQUESTS)]
        results = await asyncio.gather(*(one(client, i, p) for i, p in enumerate(plans)))
    return [(status, done, plans[i] is not None) for i, (status, done) in enumerate(results)]


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(("vllm:num_requests_", "vllm:kv_cache_usage_perc"))}


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Until nothing runs or waits, then past the engine's idle heap release (AsyncLLM.IDLE_TRIM_AFTER_S)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gauges(url)
        if g["vllm:num_requests_running"] == 0 and g["vllm:num_requests_waiting"] == 0:
            time.sleep(1.5)
            return gauges(url)
        time.sleep(0.05)
    raise TimeoutError("the server still holds requests")


def test_200_streams_with_disconnects_leak_nothing(stories_dir):
    port = free_port()
    proc = start_subprocess(stories_dir, port, "--max-num-seqs", "64")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url)
        rss = []
        for run in range(RUNS):
            results = asyncio.run(load_run(url, seed=run))
            assert not [s for s, _, _ in results if s >= 500]
            assert all(status == 200 for status, _, _ in results)
            assert all(done for _, done, leaver in results if not leaver)
            assert wait_idle(url)["vllm:kv_cache_usage_perc"] == 0.0  # every KV block back in the pool
            rss.append(rss_mib(proc.pid))
        growth = (rss[-1] - rss[WARM_UP - 1]) / (RUNS - WARM_UP)  # per warm run
        print(f"server RSS after each run (MiB): {rss}")
        assert abs(growth) < WARM_GROWTH_MIB, f"server RSS per run (MiB): {rss}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
