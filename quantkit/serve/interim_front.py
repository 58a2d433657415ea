"""TEMPORARY: a thin stand-in for quantkit.engine.async_llm.AsyncLLM until branch engine-serve lands.

Same interface as the serving contract (state, error, engine, start, generate, abort, num_waiting,
num_running, shutdown); one thread owns the LLMEngine. Deleted once AsyncLLM is merged.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from quantkit.engine.config import EngineConfig
from quantkit.engine.request import RequestStatus
from quantkit.errors import QuantkitError


class QueueFullError(QuantkitError):
    pass


class EngineDeadError(QuantkitError):
    pass


class InterimAsyncLLM:
    def __init__(self, engine_config: EngineConfig, max_queued_requests: int | None = None):
        self.cfg, self.max_queued = engine_config, max_queued_requests
        self.state, self.error, self.engine = "loading", None, None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._tracked: dict[str, tuple[object, int]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        from quantkit.engine.llm_engine import LLMEngine

        try:
            self.engine = await asyncio.to_thread(LLMEngine, self.cfg)
        except Exception as exc:
            self.state, self.error = "dead", f"{type(exc).__name__}: {exc}"
            raise
        self.state = "ready"
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) if self.engine else 0

    def num_running(self) -> int:
        return len(self.engine.scheduler.running) if self.engine else 0

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator:
        if self.state != "ready":
            raise EngineDeadError(self.error or f"engine is {self.state}")
        if self.max_queued is not None and self.num_waiting() >= self.max_queued:
            raise QueueFullError(f"{self.max_queued} requests already queued")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def shutdown(self, timeout: float) -> None:
        if self.state == "ready":
            self.state = "draining"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            await self.abort(rid)
        while self._streams and loop.time() < deadline + 5:
            await asyncio.sleep(0.05)

    def _emit(self, rid: str, out) -> None:
        target = self._streams.get(rid)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params = msg
                eng.add_request(prompt, params, rid)
                req = next((r for r in reversed(eng.scheduler.waiting) if r.request_id == rid), None)
                if req is not None:
                    self._tracked[rid] = (req, 0)
            elif msg[1] in self._tracked:
                req, _ = self._tracked.pop(msg[1])
                if req in eng.scheduler.waiting:
                    eng.scheduler.waiting.remove(req)
                if req.status != RequestStatus.FINISHED:
                    eng.scheduler.finish(req, "abort")
                    eng.sampler.release(req.request_id)
                    eng._detoks.pop(req.request_id, None)
                self._emit(msg[1], eng._output(req))

    def _loop(self) -> None:
        eng = self.engine
        while True:
            self._drain_inbox()
            if not eng.has_unfinished_requests():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                done = eng.step()
            except Exception as exc:
                self.state, self.error = "dead", f"{type(exc).__name__}: {exc}"
                for rid in list(self._streams):
                    self._emit(rid, EngineDeadError(self.error))
                return
            for out in done:
                self._tracked.pop(out.request_id, None)
                self._emit(out.request_id, out)
            for rid, (req, seen) in list(self._tracked.items()):
                if req.num_output_tokens != seen:
                    self._tracked[rid] = (req, req.num_output_tokens)
                    self._emit(rid, eng._output(req))
