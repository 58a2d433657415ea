"""POST /v1/embeddings: each input's pooled, normalized final hidden state, from the engine's own forward.

Every input is one engine request (PoolingParams: the server's --pooling), batched by the scheduler beside the
generation traffic; a client that leaves aborts them all.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from quantkit.engine.pooling import PoolingParams
from quantkit.serve.embeddings import (
    EmbeddingRequest,
    check_dimensions,
    check_input_length,
    embedding_response,
)
from quantkit.serve.errors import APIError
from quantkit.serve.fields import EMBEDDINGS
from quantkit.serve.generation import ClientGone, to_api_error, until_disconnect
from quantkit.serve.routes.common import admit, check_token_ids, log_user, prompt_token_ids

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state, engine, model = admit(request, body, EMBEDDINGS)
    check_dimensions(body.dimensions, engine.model.shape.hidden_size, model)
    prompts = prompt_token_ids(state.tokenizer, body.input, "input", body.add_special_tokens)
    check_input_length(prompts, engine.max_model_len)
    check_token_ids(state.tokenizer, prompts, "input")
    state.check_queue()
    params = PoolingParams(state.settings.pooling)
    base = f"embd-{uuid.uuid4().hex}"
    log_user(body, base)
    runs = [_embed(state.llm, ids, params, f"{base}-{i}") for i, ids in enumerate(prompts)]
    try:
        vectors = await until_disconnect(request, _all(runs))
    except ClientGone:  # cancelling the gather cancelled each run, whose stream aborts its engine request
        return JSONResponse({}, 499)
    except Exception as exc:
        raise to_api_error(exc) from exc
    return JSONResponse(embedding_response(vectors, body.encoding_format, model, sum(map(len, prompts))))


async def _all(runs: list) -> list:
    """Every run's result in order; on the first failure (or a cancellation) the others are cancelled, which aborts
    their engine requests (asyncio.gather alone would leave them running)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _embed(llm, ids: list[int], params: PoolingParams, request_id: str):
    async for out in llm.generate(ids, params, request_id):
        if out.error:
            raise APIError(500, f"the engine failed on this request: {out.error}")
        if out.finished:
            return out.embedding
    raise APIError(500, "the engine ended the request without its embedding")
