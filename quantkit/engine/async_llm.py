"""AsyncLLM: the engine's async front for a server (vLLM's AsyncLLM in spirit).

One engine thread owns the `LLMEngine`: it drains a thread-safe intake of adds and aborts between
steps, steps while there is work, and sleeps on a condition when idle. Each request's outputs go
back to its own stream through `loop.call_soon_threadsafe` (outputs are cumulative: a slow consumer
gets the newest, intermediate ones coalesce); the event loop never touches the engine. An abort is
a message to that thread, never a lock around engine state.

Failures: a step whose forward or sampler raises fails the requests of that step (finish_reason
"error") and the engine goes on; `MAX_CONSECUTIVE_FAILURES` failed steps in a row, or an error
outside the forward (the scheduler's bookkeeping), mark the engine dead: every request in flight
ends with `EngineDeadError`, none hangs.

Tokenizers: HF fast tokenizers (Rust, behind a RefCell) raise "Already borrowed" when two threads use
one at once. The engine thread owns `engine.tokenizer` (prompts, detokenization, logprob texts); the
event loop gets its own copy, `AsyncLLM.tokenizer`, made before the engine thread starts.

A consumer that stops iterating aborts its request: cancellation runs the generator's `finally`
at once; a plain `break` runs it when the generator is closed (use `contextlib.aclosing`, or let
the event loop's async-generator finalizer do it).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from quantkit.engine.config import EngineConfig
from quantkit.engine.request import RequestOutput
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.stats import EngineStats
from quantkit.errors import QuantkitError
from quantkit.memory import release_freed_memory

log = logging.getLogger("quantkit.engine")
MAX_CONSECUTIVE_FAILURES = 3
IDLE_TRIM_AFTER_S = 0.5  # glibc keeps freed heap: a server's RSS should track what it holds, not its peak


class QueueFullError(QuantkitError):
    """`max_queued_requests` requests are already waiting (a server answers 429)."""


class EngineDeadError(QuantkitError):
    """The engine loop has died; `AsyncLLM.error` says why (a server answers 500, /health 503)."""


class EngineNotReadyError(QuantkitError):
    """The engine is still loading, or draining for shutdown (a server answers 503)."""


@dataclass
class _Stream:
    """Where one request's outputs go: its event loop, the latest output (outputs are cumulative, so a
    consumer slower than the engine skips to the newest one and memory per request stays bounded, as
    in vLLM's RequestOutputCollector), and the future of its admission."""

    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | BaseException | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.call(self.loop, self.set, item)

    def set(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        last = self.latest
        if isinstance(last, BaseException) or (last is not None and last.finished):
            return  # an error or a final output is never overwritten
        self.latest = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        self.ready.clear()
        item, self.latest = self.latest, None
        return item

    def admit(self, error: BaseException | None) -> None:
        self.call(self.loop, _settle, self.admitted, error)

    @staticmethod
    def call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    """On the future's event loop: resolve it once, with `error` or None."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(None)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.set(out)


class AsyncLLM:
    def __init__(self, engine_config: EngineConfig, max_queued_requests: int | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise QuantkitError(f"max_queued_requests must be at least 1 (got {max_queued_requests})")
        self.cfg = engine_config
        self.max_queued_requests = max_queued_requests
        self.state = "loading"  # "loading" | "ready" | "draining" | "stopped" (shut down) | "dead" (failed)
        self.error: str | None = None
        self.engine = None  # the LLMEngine once loaded (read-only use from outside the engine thread)
        self.tokenizer = None  # the event loop's own tokenizer (never `engine.tokenizer`: the engine thread's)
        self._cond = threading.Condition()
        self._intake: list[tuple] = []  # ("add", id, prompt, params, arrival) | ("abort", id)
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0
        self._num_waiting = 0
        self._num_running = 0
        self._stats = EngineStats()
        self._stop = False
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Load the model in the engine thread (a server binds its port first), then start its loop.

        The engine is built in the thread that steps it: torch's OpenMP pool belongs to the thread
        that runs a parallel region, and a second thread with a pool of its own (one that only loaded
        the weights) puts more OpenMP threads in the process than cores, so libgomp stops spinning
        between regions and wakes its workers through the kernel: at 32 sequences on two cores, steps
        took 1.4x as long (docs/BENCHMARKS.md, "Serving")."""
        loop = asyncio.get_running_loop()
        loaded = loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(loop, loaded), name="quantkit-engine", daemon=True)
        self._thread.start()
        try:
            await loaded
        except Exception as exc:
            self.state, self.error = "dead", f"loading the model failed: {exc}"
            raise
        if self.state != "loading":  # shut down while loading: the loop stops at once
            self._request_stop()
            return
        self.state = "ready"

    # ---- the event loop's side ----

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as they come; the last has `finished=True`."""
        stream = self._open(prompt, params, request_id)
        finished = False
        try:
            await stream.admitted  # a bad prompt raises QuantkitError here
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._cond:
                self._streams.pop(request_id, None)
            if not finished:  # the consumer left (disconnect, cancellation): stop the work
                self._submit(("abort", request_id))

    def _open(self, prompt, params: SamplingParams, request_id: str) -> _Stream:
        self._check_accepting()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, loop.create_future())
        with self._cond:
            if self.max_queued_requests is not None and \
                    self._num_waiting + self._pending_adds >= self.max_queued_requests:
                raise QueueFullError(f"the server is overloaded: {self.max_queued_requests} requests are "
                                     f"already queued; retry later")
            if request_id in self._streams:
                raise QuantkitError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._intake.append(("add", request_id, prompt, params, time.monotonic()))
            self._cond.notify()
        return stream

    def _check_accepting(self) -> None:
        if self.state == "dead":
            raise EngineDeadError(f"the engine is dead: {self.error}")
        if self.state != "ready":
            raise EngineNotReadyError(f"the engine is {self.state}; not accepting requests")

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, item: tuple) -> None:
        with self._cond:
            self._intake.append(item)
            self._cond.notify()

    def num_waiting(self) -> int:
        with self._cond:
            return self._num_waiting + self._pending_adds

    def num_running(self) -> int:
        with self._cond:
            return self._num_running

    def get_stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step."""
        with self._cond:
            return self._stats

    async def shutdown(self, timeout: float) -> None:
        """Stop admission, let requests in flight finish for up to `timeout` s, abort the rest, stop the thread."""
        if self.state == "ready":
            self.state = "draining"
        deadline = time.monotonic() + timeout
        while self._in_flight() and time.monotonic() < deadline and self._alive():
            await asyncio.sleep(0.01)
        with self._cond:
            for rid in list(self._streams):
                self._intake.append(("abort", rid))
            self._cond.notify()
        grace = time.monotonic() + 5.0  # the aborts' final outputs reach their streams within a step
        while self._in_flight() and time.monotonic() < grace and self._alive():
            await asyncio.sleep(0.01)
        self._request_stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        if self.state != "dead":  # a failure stays one; otherwise this was a clean stop
            self.state, self.error = "stopped", "the engine was shut down"

    def _request_stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _in_flight(self) -> bool:
        with self._cond:
            return bool(self._streams)

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread ----

    def _main(self, loop: asyncio.AbstractEventLoop, loaded: asyncio.Future) -> None:
        from quantkit.engine.llm_engine import LLMEngine

        try:
            engine = LLMEngine(self.cfg)
            tokenizer = copy.deepcopy(engine.tokenizer)  # the event loop's copy, before this thread uses its own
        except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it on the event loop
            _Stream.call(loop, _settle, loaded, exc)
            return
        self.engine, self.tokenizer, self._stats = engine, tokenizer, engine.get_stats()
        _Stream.call(loop, _settle, loaded, None)
        self._run()

    def _run(self) -> None:
        failures, trimmed = 0, True
        try:
            while True:
                with self._cond:
                    # idle for IDLE_TRIM_AFTER_S: hand the heap a burst freed back to the system, once
                    woke = self._cond.wait_for(self._has_work, None if trimmed else IDLE_TRIM_AFTER_S)
                    if self._stop:
                        return
                    batch, self._intake = self._intake, []
                if not woke:
                    release_freed_memory()  # outside the lock: submitters never wait on it
                    trimmed = True
                    continue
                trimmed = False
                self._apply(batch)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                    failures = failures + 1 if self.engine.last_error is not None else 0
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        raise RuntimeError(f"{failures} engine steps failed in a row; last: "
                                           f"{self.engine.last_error!r}")
                self._snapshot()
        except Exception as exc:  # noqa: BLE001 - the loop must end every stream, whatever broke
            log.exception("the engine loop died")
            self._die(f"{type(exc).__name__}: {exc}")

    def _has_work(self) -> bool:
        return bool(self._intake) or self._stop or self.engine.has_unfinished_requests()

    def _apply(self, batch: list[tuple]) -> None:
        for item in batch:
            if item[0] == "abort":
                self.engine.abort_request(item[1])
                continue
            _, rid, prompt, params, arrival = item
            with self._cond:
                stream = self._streams.get(rid)
            error = None
            try:
                if stream is not None:
                    self.engine.add_request(prompt, params, rid, arrival, reject_bad_prompt=True)
                else:  # the consumer left before the engine saw it (a server counts it as aborted): the
                    # engine counts it too, as aborted, or as an error when the prompt is bad
                    self.engine.add_request(prompt, params, rid, arrival)
                    self.engine.abort_request(rid)
            except QuantkitError as exc:
                error = exc
            with self._cond:  # counted before the consumer hears back
                self._pending_adds -= 1
                self._num_waiting += stream is not None and error is None  # until the next snapshot
            if stream is not None:
                stream.admit(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step (not one per request): the loop sets each stream's output."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _Stream.call(loop, _deliver, items)

    def _snapshot(self) -> None:
        stats = self.engine.get_stats()
        with self._cond:
            self._stats = stats
            self._num_waiting, self._num_running = stats.num_waiting, stats.num_running

    def _die(self, error: str) -> None:
        with self._cond:
            self.state, self.error = "dead", error
            streams = list(self._streams.values())
            self._intake, self._pending_adds = [], 0
        for stream in streams:
            dead = EngineDeadError(f"the engine is dead: {error}")
            stream.admit(dead)
            stream.put(dead)
