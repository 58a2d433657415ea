"""build_app(state, settings) -> FastAPI: the routers, the error handlers, the middleware.

Extension points, so that later features add to this app rather than rewrite it:
  - `ROUTERS` lists the routers every app includes; `build_app(..., extra_routers=[...])` adds more;
  - `app.state.public_paths`: paths that need no API key (a new public endpoint adds itself here);
  - `app.state.server`: the `ServerState` every route reads (engine front, settings);
  - `startup_hooks` / `shutdown_hooks`: async callables run with the state after the engine front
    starts loading, and before it drains (a metrics exporter registers itself here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, FastAPI

from quantkit.serve.auth import APIKeyMiddleware
from quantkit.serve.errors import install_error_handlers
from quantkit.serve.routes import chat, completions, health, tokenize
from quantkit.serve.settings import ServeSettings
from quantkit.serve.state import ServerState

log = logging.getLogger("quantkit.serve")
ROUTERS: tuple[APIRouter, ...] = (health.router, completions.router, chat.router, tokenize.router)
PUBLIC_PATHS = ("/health", "/version")
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

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.public_paths = set(PUBLIC_PATHS)
    install_error_handlers(app)
    for router in (*ROUTERS, *extra_routers):
        app.include_router(router)
    app.add_middleware(APIKeyMiddleware, keys=settings.api_keys, public_paths=app.state.public_paths)
    return app


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
    except Exception:  # the front records why (state "dead"); /health says 503 and requests 500
        log.exception("the engine failed to start")
