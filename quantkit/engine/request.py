"""A request's state inside the engine, and the outputs handed back to the user (vLLM's names)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from quantkit.engine.block_pool import BlockHash, hash_block_tokens
from quantkit.engine.pooling import PoolingState
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.spec_decode import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, by recompute or with its blocks swapped to CPU
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability (from the raw logits), its rank in the vocabulary (1 = top), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Per-request timestamps (`time.monotonic()` seconds) and counts."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @staticmethod
    def _span(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    @property
    def queue_time(self) -> float | None:
        return self._span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return self._span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return self._span(self.first_token_time, self.finished_time)

    @property
    def e2e_time(self) -> float | None:
        return self._span(self.arrival_time, self.finished_time)

    @property
    def time_to_first_token(self) -> float | None:
        return self._span(self.arrival_time, self.first_token_time)


@dataclass(eq=False)
class Request:
    """Token state of one request. `num_computed_tokens` counts tokens whose KV is in the cache.

    There is no prefill or decode phase: each step the scheduler gives a request
    `num_tokens - num_computed_tokens` new tokens (or fewer, under the token budget).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    prompt: str | None = None
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    swapped_blocks: list[int] | None = None  # CPU swap block ids while swapped out
    block_hashes: list[BlockHash] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token, when params.logprobs is set
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token; entry 0 None
    text: str = ""
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding's guesses for the next step
    ngram_index: NgramIndex | None = field(default=None, repr=False)  # where the guesses are looked up
    pooling: PoolingState | None = None  # an embedding request: its prompt's states pooled, nothing sampled
    embedding: object | None = None  # the pooled vector (torch [hidden] fp32) once its prompt ran

    def __post_init__(self):
        self._all = list(self.prompt_token_ids)
        self._update_block_hashes()
        if self.metrics is None:
            self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_whole_prompt(self) -> bool:
        """Whether every prompt position must run through the model (no prefix-cache hits): prompt logprobs, or
        pooling by mean, read each position's output."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None
                                                           and self.pooling.params.needs_every_token)

    @property
    def samples(self) -> bool:
        """Whether the request samples tokens (an embedding request only pools its prompt)."""
        return self.pooling is None

    @property
    def first_token_time(self) -> float | None:
        return self.metrics.first_token_time

    @property
    def visible_text(self) -> str:
        """The text to hand out now: while running, the tail that could still become a stop string is
        held back (vLLM's rule), so the cumulative text a client sees never shrinks when a stop cuts it."""
        p = self.params
        if self.is_finished or not p.stop or p.include_stop_str_in_output:
            return self.text
        return self.text[:max(0, len(self.text) - (max(len(s) for s in p.stop) - 1))]

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generation_tokens += 1
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Chain a hash for every full block of known tokens (prompt and outputs)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self._all):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, self._all[i * bs:(i + 1) * bs]))

    def block_tokens(self, i: int) -> list[int]:
        return self._all[i * self.block_size:(i + 1) * self.block_size]


@dataclass
class CompletionOutput:
    """One sample of a request, cumulative: all text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None (still running)
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    metrics: RequestMetrics | None = None  # this sample's own, once it finished (metrics per sample, as vLLM's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a step hands back for a request that changed; cumulative (the server computes deltas)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by all of a request's outputs (not copied each step): read-only
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: object | None = None  # an embedding request's pooled vector (torch [hidden] fp32), once finished
