"""`quantkit serve` as a real process on loopback, for the production tests: start, wait, scrape, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests_support.deploy_configs import free_port

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "data" / "stories260K-hf"
# stories260K has no chat template: a one-line one, so the chat endpoint (and the chat page) work.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
START_TIMEOUT = 120.0


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def scrape(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, family: str, sample: str | None = None, **labels) -> float:
        """A sample's value summed over the label sets that match `labels`."""
        fam = self.scrape()[family]
        name = sample or family
        return sum(s.value for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def assert_quiescent(self, timeout: float = 10.0) -> None:
        """Nothing in flight, every KV block free, and the server's count of finished requests (by reason)
        equal to the engine's own count."""
        deadline = time.monotonic() + timeout
        while True:
            fams = self.scrape()
            running = _one(fams, "vllm:num_requests_running")
            waiting = _one(fams, "vllm:num_requests_waiting")
            kv = _one(fams, "vllm:kv_cache_usage_perc")
            served = sum(s.value for s in fams["vllm:request_success"].samples if s.name.endswith("_total"))
            engine = _one(fams, "quantkit:engine_finished_requests", "quantkit:engine_finished_requests_total")
            if (running, waiting, kv) == (0, 0, 0) and served == engine:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not quiescent after {timeout} s: running {running}, waiting {waiting}, "
                                     f"kv usage {kv}, request_success_total {served} vs engine finished {engine}")
            time.sleep(0.2)


def _one(fams: dict, family: str, sample: str | None = None) -> float:
    return next(s.value for s in fams[family].samples if s.name == (sample or family))


def start_server(folder: Path, *flags: str, port: int | None = None, env: dict | None = None) -> LiveServer:
    """`quantkit serve stories260K` on 127.0.0.1 with `flags`, once /health answers 200."""
    if not STORIES.exists():
        import pytest

        pytest.skip(f"shared data not found at {STORIES} (see ../shared/data/SOURCES.md)")
    port = port or free_port()
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = folder / f"server-{port}.log"
    cmd = [sys.executable, "-c", "from quantkit.cli import main; main()", "serve", str(STORIES),
           "--port", str(port), "--served-model-name", "stories", "--max-model-len", "256",
           "--kv-cache-memory", "8MiB", "--threads", "1", "--chat-template", str(template),
           "--shutdown-timeout", "5", *flags]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"quantkit serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"quantkit serve not healthy after {START_TIMEOUT} s:\n{log.read_text()[-3000:]}")
