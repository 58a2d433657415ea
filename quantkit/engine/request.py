"""A request's state inside the engine, and the outputs handed back to the user (vLLM's names)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from quantkit.engine.block_pool import BlockHash, hash_block_tokens
from quantkit.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, by recompute or with its blocks swapped to CPU
    FINISHED = "finished"


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
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "error"
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    swapped_blocks: list[int] | None = None  # CPU swap block ids while swapped out
    block_hashes: list[BlockHash] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    text: str = ""

    def __post_init__(self):
        self._all = list(self.prompt_token_ids)
        self._update_block_hashes()

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

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
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
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
