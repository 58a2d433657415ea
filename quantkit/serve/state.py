"""ServerState: the engine front, the settings, and the checks every handler starts with."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from quantkit.serve.errors import APIError
from quantkit.serve.settings import ServeSettings


@dataclass
class ServerState:
    """What the routes share. `llm` is an AsyncLLM (or anything with its interface); None until
    `make_llm` built it in the background (its imports alone take seconds: torch, transformers)."""

    llm: object | None
    settings: ServeSettings
    make_llm: Callable[[], object] | None = None
    failure: str | None = None  # why make_llm itself failed
    metrics: object | None = None  # the ServerMetrics build_app attaches
    started: float = field(default_factory=time.time)

    @property
    def engine_state(self) -> str:
        if self.failure is not None:
            return "dead"
        return "loading" if self.llm is None else self.llm.state

    @property
    def error(self) -> str | None:
        return self.failure or (self.llm.error if self.llm is not None else None)

    @property
    def engine_if_loaded(self):
        return self.llm.engine if self.engine_state in ("ready", "draining") else None

    def require_ready(self):
        """The loaded LLMEngine (read-only use), or 503 while loading, draining or stopped, 500 once the engine died."""
        state = self.engine_state
        if state == "loading":
            raise APIError(503, "the model is still loading; retry when /health answers 200",
                           headers={"Retry-After": "1"})
        if state in ("draining", "stopped"):  # stopped: the drain is over, uvicorn not yet
            raise APIError(503, "the server is shutting down and admits no new requests")
        if state == "dead":
            raise APIError(500, f"the engine failed: {self.error}")
        return self.llm.engine

    @property
    def tokenizer(self):
        """The event loop's tokenizer: the engine thread uses its own (fast tokenizers are not thread-safe)."""
        return self.llm.tokenizer

    def check_model(self, name: str | None) -> str:
        names = self.settings.served_model_names
        if name is None or name in names:
            return name or names[0]
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_queue(self) -> None:
        limit = self.settings.max_queued_requests
        if limit is not None and self.llm.num_waiting() >= limit:
            if self.metrics is not None:
                self.metrics.observe_rejected("queue_full")
            raise APIError(429, f"server overloaded: {limit} requests already queued; retry later",
                           headers={"Retry-After": "1"})
