"""GET /health (503 while loading or draining, or once the engine died; 200 when ready), /version,
/v1/models, /v1/models/{id}."""

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
    return JSONResponse({"object": "list", "data": [model_card(state, name) for name in state.settings.served_model_names]})


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    """One served name's model object; any other name is a 404 in OpenAI's error shape (code model_not_found)."""
    state = server(request)
    if model_id not in state.settings.served_model_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    return JSONResponse(model_card(state, model_id))


def model_card(state, name: str) -> dict:
    """OpenAI's model object (id, object, created, owned_by) with vLLM's extras (root, parent, max_model_len)."""
    engine = state.engine_if_loaded
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "quantkit",
            "root": state.settings.engine.model, "parent": None,
            "max_model_len": engine.max_model_len if engine is not None else None}
