"""Engine statistics, the numbers `quantkit serve` exports. Bounded: counters, running sums and
fixed-bucket histograms, never lists that grow with requests (a server runs for weeks)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from quantkit.engine.request import Request

# seconds; the upper bounds of vLLM's TTFT / inter-token buckets, roughly
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# tokens per engine step: vLLM's `vllm:iteration_tokens_total` buckets
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Histogram:
    """Counts per bucket (upper bounds `bounds`, plus one overflow bucket), with their sum and count."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def copy(self) -> Histogram:
        return replace(self, counts=list(self.counts))


@dataclass
class SpecStats:
    """Speculative decoding's counters (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verifications (a sequence's drafts checked in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts kept at position k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for k in range(num_accepted):
            self.accepted_per_position[k] += 1

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_position))


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0  # waiting requests that were preempted (swapped out or to be recomputed)
    num_swapped: int = 0  # of those, requests whose blocks wait in swap space
    num_preemptions_total: int = 0
    num_swap_outs: int = 0  # of those, preemptions by swap
    swap_blocks_used: int = 0
    swap_blocks_total: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    kv_tokens_held: int = 0  # tokens whose KV is in the cache, over all running requests
    kv_capacity_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)  # "stop" | "length" | "abort" | "error"
    time_to_first_token: Histogram = field(default_factory=Histogram)  # seconds, one per sample
    inter_token_latency: Histogram = field(default_factory=Histogram)  # seconds, between consecutive tokens
    e2e_latency: Histogram = field(default_factory=Histogram)  # seconds, arrival to finish
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))  # per step
    spec: SpecStats = field(default_factory=lambda: SpecStats())  # speculative decoding

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
    """Counters and histograms that accumulate over the engine's life; a snapshot adds the gauges."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.spec = SpecStats()

    def on_speculation(self, num_drafts: int, num_accepted: int) -> None:
        self.spec.record(num_drafts, num_accepted)

    @property
    def num_finished(self) -> int:
        return sum(self.finished_by_reason.values())

    def on_token(self, req: Request, now: float) -> None:
        """Before `req.append_token(..., now)`: count it and observe TTFT or the inter-token gap."""
        m = req.metrics
        if m.first_token_time is None:
            self.prompt_tokens += req.num_prompt_tokens
            self.ttft.observe(now - m.arrival_time)
        else:
            self.itl.observe(now - m.last_token_time)
        self.generation_tokens += 1

    def on_finished(self, req: Request) -> None:
        reason = req.finish_reason or "error"
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if req.metrics.finished_time is not None:
            self.e2e.observe(req.metrics.finished_time - req.metrics.arrival_time)
