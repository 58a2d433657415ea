"""What operators and orchestrators read: GET /metrics (Prometheus), GET /ready (readiness), and the chat
page at GET /. All three are public (no API key), like /health."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from quantkit.serve.errors import error_body
from quantkit.serve.metrics import CONTENT_TYPE
from quantkit.serve.routes.common import server

router = APIRouter()
PUBLIC_PATHS = ("/metrics", "/ready", "/")


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    state = server(request)
    if state.engine_state in ("ready", "draining"):
        state.metrics.update_from_stats(state.llm.get_stats())  # gauges and counters as of this scrape
        if state.metrics.weights_bytes is None:
            state.metrics.set_model_weights_bytes(module_bytes(state.llm.engine.model))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def module_bytes(module) -> int:
    """Bytes of a torch module's parameters and buffers (quantized weights are buffers); tied tensors once."""
    # By object identity: a tied weight is one Parameter under two names. (data_ptr() would fail on the
    # CPU kernels' packed tensors, which have no storage.)
    unique = {id(t): t for t in module.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def not_ready_reason(state) -> str | None:
    """Why a load balancer should send this replica nothing now, or None when it may."""
    engine_state = state.engine_state
    if engine_state != "ready":
        return {"loading": "the model is still loading", "draining": "the server is draining"}.get(
            engine_state, f"the engine is {engine_state}")
    cap = state.settings.max_queued_requests
    if cap is not None and state.llm.num_waiting() >= cap:
        return f"the queue is full ({cap} requests waiting)"
    return None


@router.get("/ready", include_in_schema=False)
async def ready(request: Request):
    reason = not_ready_reason(server(request))
    if reason is not None:
        return JSONResponse(error_body(503, f"not ready: {reason}"), 503)
    return Response(status_code=200)


@router.get("/", include_in_schema=False)
async def chat_page():
    page = resources.files("quantkit.serve").joinpath("static", "index.html").read_text(encoding="utf-8")
    return HTMLResponse(page)
