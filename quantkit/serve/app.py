"""build_app(state, settings) -> FastAPI: the routers, the error handlers, the middleware.

Extension points, so that later features add to this app rather than rewrite it:
  - `ROUTERS` lists the routers every app includes; `build_app(..., extra_routers=[...])` adds more;
  - `app.state.public_paths`: paths that need no API key (a new public endpoint adds itself here);
  - `app.state.server`: the `ServerState` every route reads (engine front, settings);
  - `startup_hooks` / `shutdown_hooks`: async callables run with the state after the engine front
    starts loading, and before it drains (a metrics exporter registers itself here).

Middleware, outermost first: CORS (Starlette's, with vLLM's flags: a preflight is answered before any key is asked
for, and every answer, a 401 included, carries the CORS headers a browser needs to read it), the HTTP metrics, the
API keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware

from quantkit.errors import QuantkitError
from quantkit.serve.auth import APIKeyMiddleware
from quantkit.serve.errors import install_error_handlers
from quantkit.serve.http_metrics import HTTPMetricsMiddleware
from quantkit.serve.metered import MeteredLLM
from quantkit.serve.metrics import ServerMetrics
from quantkit.serve.routes import chat, completions, embeddings, health, ops, responses, tokenize
from quantkit.serve.settings import ServeSettings
from quantkit.serve.state import ServerState

log = logging.getLogger("quantkit.serve")
ROUTERS: tuple[APIRouter, ...] = (health.router, completions.router, chat.router, responses.router, embeddings.router,
                                  tokenize.router, ops.router)
PUBLIC_PATHS = ("/health", "/version", "/openapi.json", *ops.PUBLIC_PATHS)
TOKEN_BUCKETS_UP_TO = 1_000_000  # request token histograms' last bucket when --max-model-len is not given
Hook = Callable[[ServerState], Awaitable[None]]


def build_app(state: ServerState, settings: ServeSettings, extra_routers: Sequence[APIRouter] = (),
              startup_hooks: Sequence[Hook] = (), shutdown_hooks: Sequence[Hook] = ()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Load in the background: the port is bound and /health answers 503 while the model loads.
        loading = asyncio.create_task(_start(state))
        for hook in startup_hooks:
            await hook(state)
        try:
            yield
        finally:
            for hook in shutdown_hooks:
                await hook(state)
            if not loading.done():
                loading.cancel()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    app.state.public_paths = set(PUBLIC_PATHS)
    _meter(state, settings)
    install_error_handlers(app)
    for router in (*ROUTERS, *extra_routers):
        app.include_router(router)
    ring = settings.key_ring()
    state.metrics.register(ring)
    app.add_middleware(APIKeyMiddleware, ring=ring, public_paths=app.state.public_paths,
                       on_reject=state.metrics.observe_rejected)
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)  # sees the 401s and 429s too
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)
    return app


def _meter(state: ServerState, settings: ServeSettings) -> None:
    """Attach the server's metrics, and observe every request through the engine front."""
    state.metrics = ServerMetrics(settings.model_name, settings.engine.max_model_len or TOKEN_BUCKETS_UP_TO)
    if state.llm is not None:
        state.llm = MeteredLLM(state.llm, state.metrics)
    if state.make_llm is not None:
        make = state.make_llm
        state.make_llm = lambda: MeteredLLM(make(), state.metrics)


async def _start(state: ServerState) -> None:
    if state.llm is None:
        try:
            state.llm = await asyncio.to_thread(state.make_llm)
        except Exception as exc:  # e.g. a missing optional dependency: /health says 503, requests 500
            state.failure = f"{type(exc).__name__}: {exc}"
            log.exception("the engine front could not be built")
            return
    try:
        await state.llm.start()
    except QuantkitError as exc:  # bad input (a corrupt checkpoint): its one line says it all, no traceback
        log.error("the engine failed to start: %s", exc)
    except Exception:  # the front records why (state "dead"); /health says 503 and requests 500
        log.exception("the engine failed to start")
