"""The engine front seen through the server's metrics: every output a request yields is observed.

`MeteredLLM` wraps the AsyncLLM: `generate` passes each cumulative output on
unchanged, and on the way records the request's token times (inter-token latency), its finished
metrics, the tokens it used against the API key's lease, and queue-full rejections. Everything
else is the wrapped front's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from quantkit.engine.async_llm import QueueFullError
from quantkit.serve.auth import current_lease
from quantkit.serve.metrics import ServerMetrics, TokenClock


class MeteredLLM:
    def __init__(self, llm, metrics: ServerMetrics):
        self.inner, self.metrics = llm, metrics

    def __getattr__(self, name):  # state, error, engine, start, abort, num_waiting, shutdown, ...
        return getattr(self.inner, name)

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator:
        """The wrapped front's outputs, observed. A finished output is accounted before it is passed on:
        a consumer that stops at the finished output never resumes this generator, whose `finally` then
        runs only when it is collected, outside the request."""
        clock, usage, last, ended = TokenClock(), _Usage(current_lease.get()), None, "abort"
        try:
            async for out in self.inner.generate(prompt, params, request_id):
                clock.update(out)
                usage.update(out)
                last = out
                if out.finished:
                    self._account(clock, last, "finished", params.n)
                yield out
        except Exception as exc:
            if isinstance(exc, QueueFullError):  # the front's own admission check
                self.metrics.observe_rejected("queue_full")
            ended = "error"
            raise
        finally:
            if last is None or not last.finished:
                self._account(clock, last, ended, params.n)

    def _account(self, clock: TokenClock, last, ended: str, num_samples: int) -> None:
        """Once per request, however it ended: finished, aborted (the client left), or failed; each of its
        samples counts, as the engine counts them. A request refused before any output (queue full, bad
        prompt) never ran and counts as no request."""
        self.metrics.observe_token_times(clock.times)
        if last is not None and last.finished:
            self.metrics.observe_finished(last)
        elif last is not None or ended == "abort":
            self.metrics.observe_unfinished(last, ended, num_samples)


class _Usage:
    """Charges a request's tokens (prompt + generated) to its API key's lease as they come, so that a
    request cut short still pays for what it used."""

    def __init__(self, lease):
        self.lease, self.charged = lease, 0

    def update(self, out) -> None:
        used = len(out.prompt_token_ids) + sum(len(c.token_ids) for c in out.outputs)
        if self.lease is not None and used > self.charged:
            self.lease.add_tokens(used - self.charged)
        self.charged = max(self.charged, used)
