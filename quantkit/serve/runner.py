"""Run the app under uvicorn with our own signal handling: SIGTERM/Ctrl-C drains, then exits 0.

The drain: the engine front stops admission (new requests get 503), requests in flight get up to
`shutdown_timeout` seconds to finish, the rest are aborted (finish_reason "abort"), then uvicorn
closes its connections. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
from collections.abc import Callable

import uvicorn

from quantkit.serve.app import build_app
from quantkit.serve.settings import ServeSettings
from quantkit.serve.state import ServerState


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # ours are installed by `serve`: uvicorn's would exit without draining
        yield


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the `serve` extra), else None (asyncio's own). Every
    streamed token passes through the loop's callbacks and socket writes: at 32 streams on two cores,
    uvloop and httptools (which uvicorn picks by itself when installed) took 10-25% off the inter-token
    latency in docs/BENCHMARKS.md ("Serving")."""
    if importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop

    return uvloop.new_event_loop


def transport_names() -> str:
    """What carries the HTTP traffic, for the start-up line: the parser uvicorn's "auto" picks, the loop."""
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    return f"{http} on {loop}"


def listen_options(settings: ServeSettings) -> dict:
    """uvicorn.Config's options for where the server listens: a Unix socket (--uds) or host and port, and the
    prefix a proxy serves it under (--root-path: uvicorn puts it in front of every request's path, which the
    routes take off, and the OpenAPI document names it as the server's URL)."""
    where = {"uds": str(settings.uds)} if settings.uds is not None else {"host": settings.host, "port": settings.port}
    return {**where, "root_path": settings.root_path}


def make_front(settings: ServeSettings):
    from quantkit.engine.async_llm import AsyncLLM

    return AsyncLLM(settings.engine, max_queued_requests=settings.max_queued_requests)


def serve_until_stopped(settings: ServeSettings, say: Callable[[str], None] = print) -> str | None:
    """`serve` on its own event loop (uvloop's where installed), until a signal drains it."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(serve(settings, say))


async def serve(settings: ServeSettings, say: Callable[[str], None] = print, app_factory=build_app) -> str | None:
    """Serve until a signal drains the server; returns why the engine failed to load, if it did."""
    state = ServerState(None, settings, make_llm=lambda: make_front(settings))
    app = app_factory(state, settings)
    config = uvicorn.Config(app, **listen_options(settings), log_level=settings.log_level,
                            lifespan="on", access_log=False, timeout_graceful_shutdown=5)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if draining:  # a second signal: stop now
            server.force_exit = True
            server.should_exit = True
            return
        say(f"{sig.name}: draining (up to {settings.shutdown_timeout:g} s for requests in flight)")
        draining.append(asyncio.ensure_future(_drain(state, server, settings.shutdown_timeout)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    announcer = asyncio.ensure_future(_announce_when_ready(state, server, settings, say))
    try:
        await server.serve()
    finally:
        announcer.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        failure = state.error if state.engine_state == "dead" and not draining else None  # before our own stop
        if state.engine_state not in ("dead", "loading", "stopped") and not draining:
            await state.llm.shutdown(0)
    return failure


async def _drain(state: ServerState, server: uvicorn.Server, timeout: float) -> None:
    try:
        if state.llm is not None:
            await state.llm.shutdown(timeout)
    finally:
        server.should_exit = True


async def _announce_when_ready(state: ServerState, server: uvicorn.Server, settings: ServeSettings,
                               say: Callable[[str], None]) -> None:
    say(f"loading {settings.engine.model} (served as {', '.join(settings.served_model_names)}); "
        f"{settings.url('/health')} answers 503 until it is ready")
    while state.engine_state == "loading":
        await asyncio.sleep(0.05)
    if state.engine_state == "dead":
        server.should_exit = True  # a server that can never answer should not sit on its port
        return
    engine = state.llm.engine
    say(f"model {settings.engine.model}: max_model_len {engine.max_model_len}")
    say(engine.kv_plan.describe())
    say(f"ready: serving the OpenAI API on {settings.url('/v1')} ({transport_names()})")
