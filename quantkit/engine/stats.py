"""Engine statistics, the numbers `quantkit serve` will export."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.engine.request import Request


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0  # waiting requests that were preempted (swapped out or to be recomputed)
    num_preemptions_total: int = 0
    num_swap_outs: int = 0  # of those, preemptions by swap
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    kv_tokens_held: int = 0  # tokens whose KV is in the cache, over all running requests
    kv_capacity_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0
    time_to_first_token: list[float] = field(default_factory=list)  # seconds, one per finished request
    inter_token_latency: list[float] = field(default_factory=list)  # seconds, between consecutive tokens

    @property
    def kv_token_utilization(self) -> float:
        return self.kv_tokens_held / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class StepStats:
    """What the last step ran: gauges taken at the forward, when the pool is as full as it gets."""

    num_scheduled_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0  # > 0: the scheduler could not admit everyone (pool, budget or max_num_seqs)
    kv_tokens: int = 0  # tokens whose KV is in the cache once this step's forward has run
    kv_block_usage: float = 0.0  # fraction of blocks held by requests during the forward
    num_preempted: int = 0


class StatsCollector:
    """Counters that accumulate over the engine's life; a snapshot adds the current gauges."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_finished = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def on_tokens(self, num_prompt: int, num_generated: int) -> None:
        self.prompt_tokens += num_prompt
        self.generation_tokens += num_generated

    def on_finished(self, req: Request) -> None:
        self.num_finished += 1
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
        times = req.token_times
        self.itl.extend(b - a for a, b in zip(times, times[1:]))
