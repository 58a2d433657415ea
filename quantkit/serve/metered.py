"""The engine front seen through the server's metrics: every output a request yields is observed.

`MeteredLLM` wraps an AsyncLLM (or the interim front): `generate` passes each cumulative output on
unchanged, and on the way records the request's token times (inter-token latency), its finished
metrics, the tokens it used against the API key's lease, and queue-full rejections. Everything
else is the wrapped front's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from quantkit.serve.auth import current_lease
from quantkit.serve.metrics import ServerMetrics, TokenClock


class MeteredLLM:
    def __init__(self, llm, metrics: ServerMetrics):
        self.inner, self.metrics = llm, metrics

    def __getattr__(self, name):  # state, error, engine, start, abort, num_waiting, shutdown, ...
        return getattr(self.inner, name)

    def get_stats(self):
        getter = getattr(self.inner, "get_stats", None)  # AsyncLLM's snapshot; the interim front has none
        return getter() if getter is not None else self.inner.engine.get_stats()

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator:
        clock, last, ended = TokenClock(), None, "abort"  # a consumer that stops iterating aborts it
        try:
            async for out in self.inner.generate(prompt, params, request_id):
                clock.update(out, time.monotonic())
                last = out
                yield out
        except Exception as exc:
            if type(exc).__name__ == "QueueFullError":  # the front's own admission check
                self.metrics.observe_rejected("queue_full")
            ended = "error"
            raise
        finally:
            self._account(clock, last, ended)

    def _account(self, clock: TokenClock, last, ended: str) -> None:
        """Once per request, however it ended: finished, aborted (the client left), or failed. A request
        refused before any output (queue full, bad prompt) never ran and counts as no request."""
        self.metrics.observe_token_times(clock.times)
        if last is None:
            if ended == "abort":
                self.metrics.observe_unfinished("abort")
            return
        used = len(last.prompt_token_ids) + sum(len(c.token_ids) for c in last.outputs)
        lease = current_lease.get()
        if lease is not None:
            lease.add_tokens(used)
        if last.finished:
            self.metrics.observe_finished(last)
        else:
            self.metrics.observe_unfinished(ended)
