"""GET /health (503 while loading or draining, or once the engine died; 200 when ready), /version,
/v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import quantkit
from quantkit.serve.errors import APIError, error_response
from quantkit.serve.routes.common import server

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    try:
        server(request).require_ready()
    except APIError as exc:
        return error_response(APIError(503, exc.message, headers=exc.headers))
    return Response(status_code=200)


@router.get("/version")
async def version():
    return {"version": quantkit.__version__}


@router.get("/v1/models")
async def models(request: Request):
    state = server(request)
    engine = state.engine_if_loaded
    data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "quantkit",
             "root": state.settings.engine.model, "parent": None,
             "max_model_len": engine.max_model_len if engine is not None else None}
            for name in state.settings.served_model_names]
    return JSONResponse({"object": "list", "data": data})
