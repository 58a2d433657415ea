"""POST /v1/responses (OpenAI's Responses API), stateless: the request holds the whole conversation.

The fields are checked against fields.FIELDS first (a 400 names anything not honoured), the input becomes
chat messages through the chat template (responses_in), the engine runs one sample, and responses_out turns its
output into the response object or its stream of events. Nothing is stored, so the routes that read stored responses
answer 400 and say why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantkit.engine.request import CompletionOutput, RequestOutput
from quantkit.serve.chat_template import render_conversation
from quantkit.serve.errors import APIError
from quantkit.serve.fields import RESPONSES, STATELESS, check_fields
from quantkit.serve.generation import ClientGone, Job, to_api_error, until_disconnect
from quantkit.serve.responses import Format, chat_logprobs
from quantkit.serve.responses_in import (ResponsesRequest, validated, conversation, input_items, num_logprobs,
                                         sampling_params, structured_output, tool_request)
from quantkit.serve.responses_out import ResponseEvents, output_decoder, sse_event, usage
from quantkit.serve.routes.common import encode, server
from quantkit.serve.sampling import check_context
from quantkit.serve.tool_choice import plan_tools

log = logging.getLogger("quantkit.serve")
router = APIRouter()
INCOMPLETE = {"length": "max_output_tokens"}  # engine finish_reason -> incomplete_details.reason
CONTEXT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}  # check_context's names -> these


@router.post("/v1/responses")
async def create_response(request: Request, raw: dict[str, Any] = Body(...)):
    check_fields(RESPONSES, raw)
    body = validated(ResponsesRequest, raw, "")
    state = server(request)
    engine = state.require_ready()
    model = state.check_model(body.model)
    if body.user or body.safety_identifier:
        log.info("responses request: user=%s safety_identifier=%s", body.user, body.safety_identifier)
    plan = plan_tools(tool_request(body), state.settings.enable_auto_tool_choice, state.settings.tool_call_parser)
    spec = structured_output(body, plan)
    text = render_conversation(state.tokenizer, conversation(body.instructions, input_items(body.input)),
                               state.settings.chat_template, add_generation_prompt=True, tools=plan.tools or None)
    ids = encode(state.tokenizer, text, add_special_tokens=False)
    try:
        max_tokens = check_context(len(ids), body.max_output_tokens, engine.max_model_len)
    except APIError as exc:
        exc.param = CONTEXT_PARAMS.get(exc.param, exc.param)
        raise
    top_logprobs = num_logprobs(body, plan)
    params = sampling_params(body, max_tokens, spec, top_logprobs)
    state.check_queue()
    events = ResponseEvents(body, model, plan.max_calls,
                            obfuscate=body.stream_options is None or body.stream_options.include_obfuscation)
    # The Job drives the engine request (admission, disconnects, aborts); its Format is the chat endpoint's, unused
    # here but for its fields, since responses_out writes this endpoint's bodies. The engine request is named resp_...
    job = Job(state, Format(chat=True, model=model, tokenizer=None, top_logprobs=None), [ids], params)
    job.request_ids = [events.id]
    run = _Run(job, events, output_decoder(plan),
               None if top_logprobs is None else Logprobs(state.tokenizer, top_logprobs))
    return await (run.stream(request) if body.stream else run.respond(request))


@dataclass
class Logprobs:
    """The output tokens' logprobs asked for (include message.output_text.logprobs), as chat writes them."""

    tokenizer: object
    top: int  # alternatives per token (top_logprobs)
    sent: int = 0  # tokens reported so far

    def new(self, sample: CompletionOutput) -> list[dict]:
        start, self.sent = self.sent, len(sample.token_ids)
        return chat_logprobs(self.tokenizer, sample, start, self.sent, self.top)["content"]


class _Run:
    """One response: the engine request's outputs -> the decoder's pieces -> the response's events."""

    def __init__(self, job: Job, events: ResponseEvents, decoder, logprobs: Logprobs | None = None):
        self.job, self.events, self.decoder, self.logprobs, self.sent = job, events, decoder, logprobs, 0

    def _step(self, out: RequestOutput) -> list[dict]:
        sample = out.outputs[0]
        delta, self.sent = sample.text[self.sent:], len(sample.text)
        if self.logprobs is not None:
            self.events.logprobs(self.logprobs.new(sample))
        pieces = self.events.pieces(self.decoder.feed(delta))
        if not sample.finished:
            return pieces
        if sample.finish_reason not in ("stop", "length"):
            raise APIError(500, f"the engine ended this response: {sample.finish_reason}")
        pieces += self.events.pieces(self.decoder.finish())
        return pieces + self.events.finish(usage(len(out.prompt_token_ids), len(sample.token_ids)),
                                           INCOMPLETE.get(sample.finish_reason))

    async def respond(self, request: Request):
        async def collect() -> list[dict]:
            last: list[dict] = []
            async for _, out in self.job.outputs():
                last = self._step(out) or last
            return last

        try:
            events = await until_disconnect(request, collect())
        except ClientGone:
            return await self.job.client_gone()
        except Exception as exc:
            raise to_api_error(exc) from exc
        return JSONResponse(events[-1]["response"])

    async def stream(self, request: Request):
        started = await self.job.first_output(request)
        if isinstance(started, JSONResponse):
            return started
        outputs, (_, first) = started
        return StreamingResponse(self._sse(outputs, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(self, outputs: AsyncIterator, first: RequestOutput) -> AsyncIterator[str]:
        finished = False
        try:
            for event in self.events.start():
                yield sse_event(event)
            out = first
            while True:
                for event in self._step(out):
                    yield sse_event(event)
                if out.outputs[0].finished:
                    break
                out = (await outputs.__anext__())[1]
            finished = True
            await outputs.aclose()
        except Exception as exc:
            finished = True
            for event in self.events.fail(to_api_error(exc).message):
                yield sse_event(event)
        finally:
            if not finished:  # the client left: cancelled here, abort what is left in the engine
                await self.job.abort_all()


async def _stateless(response_id: str):
    raise APIError(400, f"response {response_id!r} cannot be read or changed: {STATELESS} (store is accepted, but "
                        "nothing is kept)", param="response_id")


STORED_RESPONSE_ROUTES = {"/v1/responses/{response_id}": ["GET", "DELETE"],  # what a stateful server would serve
                          "/v1/responses/{response_id}/cancel": ["POST"],
                          "/v1/responses/{response_id}/input_items": ["GET"]}
for _path, _methods in STORED_RESPONSE_ROUTES.items():
    for _method in _methods:  # one route a method: each its own OpenAPI operation id
        router.add_api_route(_path, _stateless, methods=[_method], name=f"stored_response_{_method.lower()}")
