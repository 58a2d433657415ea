"""Drive engine requests for one HTTP request: admission, disconnect watching, streaming, collecting.

A handler builds `Job` (its prompts' token ids and the SamplingParams), then either `respond()`s
with a full body or `stream()`s SSE chunks. Both abort every engine request of the job when the
client goes away: a stream once it started through Starlette cancelling the body iterator; before
its first output, and a non-streaming request throughout, through a watcher on the ASGI receive
channel (then the status is 499, the client closed the request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantkit.engine.request import CompletionOutput, RequestOutput
from quantkit.engine.sampling_params import SamplingParams
from quantkit.errors import QuantkitError
from quantkit.serve.errors import APIError, sse_error
from quantkit.serve.responses import SSE_DONE, Format, next_text_offset, sse, usage, vllm_prompt_logprobs
from quantkit.serve.state import ServerState

log = logging.getLogger("quantkit.serve")
Item = tuple[int, RequestOutput]  # (prompt index, cumulative output)


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def to_api_error(exc: BaseException) -> APIError:
    from quantkit.engine.async_llm import EngineDeadError, EngineNotReadyError, QueueFullError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc))
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc))
    if isinstance(exc, QuantkitError):
        return APIError(400, str(exc))
    log.exception("request failed", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, coro):
    """Await `coro`; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


@dataclass
class Job:
    state: ServerState
    fmt: Format
    prompts: list[list[int]]
    params: SamplingParams
    stream_usage: bool = False
    continuous_usage: bool = False
    keep: int | None = None  # best_of: the engine runs params.n samples, the `keep` most likely are returned
    request_ids: list[str] = field(default_factory=list)

    @classmethod
    def for_body(cls, state: ServerState, fmt: Format, prompts: list[list[int]], params: SamplingParams, body) -> Job:
        """A job with the body's stream_options (`include_usage`, `continuous_usage_stats`), and the server's --seed
        where the body gave no seed."""
        opts = body.stream_options
        usage_on = bool(opts and opts.include_usage)
        keep = body.n if params.n > body.n else None
        return cls(state, fmt, prompts, state.settings.default_seed(params), usage_on,
                   usage_on and opts.continuous_usage_stats, keep)

    async def run(self, request: Request, stream: bool):
        return await (self.stream(request) if stream else self.respond(request))

    def __post_init__(self):
        self.request_ids = [f"{self.fmt.id}-{i}" for i in range(len(self.prompts))]

    async def _one(self, i: int) -> AsyncIterator[Item]:
        async for out in self.state.llm.generate(self.prompts[i], self.params, self.request_ids[i]):
            if out.error:  # bad prompts are refused at admission: this is the engine failing mid-run
                raise APIError(500, f"the engine failed on this request: {out.error}")
            yield i, out

    async def outputs(self) -> AsyncIterator[Item]:
        """Every prompt's outputs, merged as they come."""
        if len(self.prompts) == 1:
            async for item in self._one(0):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i):
            try:
                async for item in self._one(i):
                    queue.put_nowait((item, None))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((None, exc))
            finally:
                queue.put_nowait((None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item, exc = await queue.get()
                if exc is not None:
                    raise exc
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def abort_all(self) -> None:
        for rid in self.request_ids:
            await self.state.llm.abort(rid)

    async def client_gone(self) -> JSONResponse:
        """Abort what the job left in the engine; the status the access log and metrics record (nginx's 499:
        the client closed the request). Nobody reads the body."""
        await self.abort_all()
        return JSONResponse({}, 499)

    async def respond(self, request: Request):
        """The whole response once every request finished (404/400/429/500 as APIError)."""
        async def collect():
            finals: dict[int, RequestOutput] = {}
            async for i, out in self.outputs():
                finals[i] = out
            return finals

        try:
            finals = await until_disconnect(request, collect())
        except ClientGone:
            return await self.client_gone()
        except Exception as exc:
            raise to_api_error(exc) from exc
        n = self.keep or self.params.n
        choices = [self.fmt.full_choice(i * n + rank, i, c, finals[i]) for i in sorted(finals)
                   for rank, c in enumerate(self._kept(finals[i].outputs))]
        body = self.fmt.envelope(choices, chunk=False)
        if self.fmt.chat and self.fmt.vllm_prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(finals[0])
        body["usage"] = self._usage(finals.values())
        return JSONResponse(body)

    def _kept(self, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """All samples, or best_of's `keep` of highest cumulative logprob (vLLM's ranking), most likely first."""
        if self.keep is None:
            return outputs
        return sorted(outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:self.keep]

    @staticmethod
    def _usage(outs) -> dict:
        outs = list(outs)
        return usage(sum(len(o.prompt_token_ids) for o in outs),
                     sum(len(c.token_ids) for o in outs for c in o.outputs))

    async def first_output(self, request: Request) -> tuple[AsyncIterator[Item], Item] | JSONResponse:
        """The outputs and the first of them, or the 499 response when the client left first (while queued or
        prefilling, as a non-streaming client can). Until the first output a stream sends no header: admission
        errors are still proper HTTP statuses."""
        it = self.outputs()
        try:
            return it, await until_disconnect(request, it.__anext__())
        except ClientGone:
            return await self.client_gone()
        except Exception as exc:
            raise to_api_error(exc) from exc

    async def stream(self, request: Request) -> StreamingResponse | JSONResponse:
        started = await self.first_output(request)
        if isinstance(started, JSONResponse):
            return started
        it, first = started
        return StreamingResponse(self._events(it, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, it: AsyncIterator[Item], first: Item) -> AsyncIterator[str]:
        n = self.params.n
        sent: dict[int, tuple[int, int, int]] = {}  # choice index -> (chars, tokens, next text_offset) sent
        latest: dict[int, RequestOutput] = {}
        finished = False
        try:
            for chunk in self.fmt.first_chunks(list(range(len(self.prompts) * n))):
                yield sse(chunk)
            item = first
            while item is not None:
                i, out = item
                latest[i] = out
                for c in out.outputs:
                    for chunk in self._delta(i * n + c.index, i, c, sent, out):
                        if self.continuous_usage:
                            chunk["usage"] = self._usage(latest.values())
                        yield sse(chunk)
                item = await it.__anext__() if not _all_done(latest, len(self.prompts)) else None
            finished = True
            await it.aclose()  # release the engine streams now, not when the generator is collected
            if self.stream_usage:
                tail = self.fmt.envelope([], chunk=True)
                tail["usage"] = self._usage(latest.values())
                yield sse(tail)
        except StopAsyncIteration:
            finished = True
        except Exception as exc:
            finished = True
            err = to_api_error(exc)
            yield sse_error(err.status, err.message)
        finally:
            if not finished:  # the client left: cancelled here, abort what is left in the engine
                await self.abort_all()
        yield SSE_DONE

    def _delta(self, index: int, prompt_index: int, c, sent: dict, req: RequestOutput) -> list[dict]:
        chars, toks, offset = sent.get(index, (0, 0, 0))
        if toks < 0:
            return []  # this choice already finished
        done = c.finish_reason is not None
        text = c.text[chars:]
        if not text and not done and len(c.token_ids) == toks:
            return []  # nothing new (a token whose text is held back still gets its chunk, as vLLM sends)
        prompt_lp = None
        if self.fmt.echo_texts and index not in sent:
            text = self.fmt.echo_texts[prompt_index] + text
            prompt_lp = self.fmt.prompt_logprobs(req)
        choices = self.fmt.delta_choices(index, text, c, toks, len(c.token_ids), offset, done, prompt_lp)
        lp = choices[0]["logprobs"] if choices else None
        sent[index] = (len(c.text), -1 if done else len(c.token_ids), next_text_offset(lp, offset))
        return [self.fmt.envelope([choice], chunk=True) for choice in choices]


def _all_done(latest: dict[int, RequestOutput], num_prompts: int) -> bool:
    return len(latest) == num_prompts and all(o.finished for o in latest.values())
