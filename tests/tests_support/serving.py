"""Real servers for the serving tests: uvicorn in a thread (in-process: the engine is inspectable)
or `quantkit serve` as a subprocess (signals). Both listen on 127.0.0.1 on a free port."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn

from quantkit.engine.config import EngineConfig
from quantkit.serve.app import build_app
from quantkit.serve.runner import listen_options, make_front
from quantkit.serve.settings import ServeSettings
from quantkit.serve.state import ServerState

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, want: int = 200, timeout: float = 120.0, uds=None) -> None:
    """Until GET {url}/health answers `want`; `uds`: the Unix socket of a server listening on one (--uds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        transport = httpx.HTTPTransport(uds=str(uds)) if uds is not None else None
        with contextlib.suppress(httpx.HTTPError), httpx.Client(transport=transport, timeout=5) as http:
            if http.get(f"{url}/health").status_code == want:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health did not answer {want} within {timeout} s")


@dataclass
class Running:
    url: str
    state: ServerState
    server: uvicorn.Server

    @property
    def engine(self):
        return self.state.llm.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request (aborts are processed by the engine thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.llm.num_running() == 0 and self.state.llm.num_waiting() == 0:
                return
            time.sleep(0.02)
        raise TimeoutError("the engine still holds requests")

    @contextlib.contextmanager
    def paced(self, seconds_per_step: float) -> Iterator[None]:
        """Each engine step takes `seconds_per_step` longer, as a bigger model's would: a test's window (a
        queue that stays full, a stream still running when the user presses Stop) then lasts long enough to
        be seen from outside whatever this machine's speed. The steps themselves are the real ones."""
        engine = self.engine
        step = engine.step

        def paced_step():
            time.sleep(seconds_per_step)  # releases the GIL: the server and the clients run meanwhile
            return step()

        engine.step = paced_step
        try:
            yield
        finally:
            del engine.step  # the class's method again

    def free_blocks(self) -> int:
        """From the engine thread's snapshot after its last step (never reads the pool mid-step)."""
        return self.state.llm.get_stats().kv_blocks_free


def settings_for(model, **kw) -> ServeSettings:
    engine_keys = set(EngineConfig.__slots__) - set(ServeSettings.__slots__)  # seed: the server's (it sets the engine's)
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in engine_keys}
    engine_kw.setdefault("num_threads", 1)
    engine_kw.setdefault("max_num_seqs", 16)
    engine_kw.setdefault("dtype", "float32")  # the serving tests compare with fp32 references; bf16: tests/engine
    return ServeSettings(EngineConfig(model=str(model), **engine_kw), port=free_port(), **kw)


@contextlib.contextmanager
def serve_in_thread(settings: ServeSettings, make_llm=None, ready: bool = True) -> Iterator[Running]:
    state = ServerState(None, settings, make_llm=make_llm or (lambda: make_front(settings)))
    app = build_app(state, settings)
    server = uvicorn.Server(uvicorn.Config(app, **listen_options(settings), log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = "http://localhost" if settings.uds is not None else f"http://127.0.0.1:{settings.port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if ready:
            wait_health(url, uds=settings.uds)
        yield Running(url, state, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if state.llm is not None and state.engine_state in ("ready", "draining"):
            import asyncio

            asyncio.run(state.llm.shutdown(0))


def start_subprocess(model, port: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(model), "--port", str(port),
                             "--threads", "1", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def serve_until_it_exits(model, timeout: float) -> tuple[int, str]:
    """(exit status, combined output) of a `quantkit serve MODEL` expected to stop by itself (a refused model);
    one that runs past `timeout` seconds is killed, and TimeoutExpired raised."""
    proc = start_subprocess(model, free_port())
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, output
