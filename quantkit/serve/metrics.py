"""Prometheus metrics for `quantkit serve`, under vLLM's names, labels, HELP texts and buckets.

Dashboards and autoscaler rules written for vLLM read these unchanged: the `vllm:` families carry the
labels `model_name` and `engine` (always "0": one engine per server) as vLLM's v1 logger does. What vLLM
has no metric for gets a `quantkit:` prefix; HTTP traffic is `http_requests_total` /
`http_request_duration_seconds` by handler (route template), method and status code.

Everything is bounded: gauges, counters and fixed-bucket histograms in a registry of our own (never
prometheus-client's global one, so two servers in one process do not collide).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM v1's default bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Serving-side latency of any HTTP route (the high-resolution set of prometheus-fastapi-instrumentator).
HTTP_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
                        10, 30, 60)

FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "unauthorized", "requests_per_minute", "tokens_per_minute", "concurrent_requests")


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def counter_delta(current: float, previous: float) -> float:
    """What to add to a Prometheus counter mirroring an engine total. A total that went down means the
    engine restarted its count: the whole new total is new."""
    return current - previous if current >= previous else current


class ServerMetrics:
    """The server's metric families and the calls that feed them. Thread-safe (prometheus-client is)."""

    def __init__(self, model_name: str, max_model_len: int):
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name, "engine": "0"}
        self._engine_totals: dict[str, float] = {}
        self.weights_bytes: int | None = None  # set once the model is loaded
        self._lock = threading.Lock()  # delta bookkeeping of update_from_stats
        self._build_gauges()
        self._build_counters()
        self._build_histograms(max_model_len)
        self._build_http()

    # -- construction ---------------------------------------------------------------------------------

    def _family(self, cls, name: str, doc: str, extra: Sequence[str] = (), **kw) -> Any:
        names = ("model_name", "engine", *extra)
        return cls(name, doc, labelnames=names, registry=self.registry, **kw)

    def _build_gauges(self) -> None:
        g = lambda name, doc: self._family(Gauge, name, doc).labels(**self._labels)  # noqa: E731
        self.num_requests_running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_requests_swapped = g(
            "quantkit:num_requests_swapped", "Number of requests whose KV blocks are swapped out to CPU memory.")
        self.swap_blocks_in_use = g("quantkit:swap_blocks_in_use", "Number of CPU swap blocks holding KV.")
        self.model_weights_bytes = g("quantkit:model_weights_bytes", "Memory held by the model weights, in bytes.")

    def _build_counters(self) -> None:
        c = lambda name, doc: self._family(Counter, name, doc).labels(**self._labels)  # noqa: E731
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = c(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = c(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.engine_finished = c(
            "quantkit:engine_finished_requests",
            "Requests the engine finished for any reason, by its own count, each sample of a request with n > 1 "
            "one; equals the sum of vllm:request_success_total whenever no request is in flight.")
        # As vLLM's: one per finished sample (a request with n samples counts n).
        success = self._family(Counter, "vllm:request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        self.request_success = {r: success.labels(**self._labels, finished_reason=r) for r in FINISH_REASONS}
        # speculative decoding, as vLLM's (zero without --speculative-config)
        self.spec_drafts = c("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = c("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = c("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_position = self._family(
            Counter, "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            ("position",))
        rejected = self._family(
            Counter, "quantkit:requests_rejected",
            "Requests refused before reaching the engine (queue full, missing or wrong API key, rate limits), "
            "by reason.", ("reason",))
        self.requests_rejected = {r: rejected.labels(**self._labels, reason=r) for r in REJECT_REASONS}

    def _build_histograms(self, max_model_len: int) -> None:
        def h(name: str, doc: str, buckets: Sequence[float]):
            return self._family(Histogram, name, doc, buckets=buckets).labels(**self._labels)

        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = h(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        # Observed by the engine thread at every step: exported from the engine's own bounded histogram.
        self.iteration_tokens = EngineHistogram("vllm:iteration_tokens_total",
                                                "Histogram of number of tokens per engine_step.",
                                                self._labels, ITERATION_TOKENS_BUCKETS)
        self.registry.register(self.iteration_tokens)
        self.time_to_first_token = h("vllm:time_to_first_token_seconds",
                                     "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = h("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = h(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        lat = REQUEST_LATENCY_BUCKETS
        self.e2e_latency = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat)
        self.queue_time = h("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", lat)
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", lat)
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", lat)
        self.decode_time = h("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", lat)

    def _build_http(self) -> None:
        names = ("handler", "method", "status")
        self.http_requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                     labelnames=names, registry=self.registry)
        self.http_latency = Histogram("http_request_duration_seconds",
                                      "Time from request start to the end of its response body, by handler.",
                                      labelnames=("handler", "method"), buckets=HTTP_LATENCY_BUCKETS,
                                      registry=self.registry)

    def register(self, collector: Collector) -> None:
        """Add a collector (the API keys' usage counters) to this server's registry."""
        self.registry.register(collector)

    # -- feeding ------------------------------------------------------------------------------------

    def observe_finished(self, output: Any) -> None:
        """One finished RequestOutput (per the serving contract). As vLLM counts them, each of its samples (n of
        them) is one finished request: its reason, token counts and phase times."""
        for sample in output.outputs:
            self._observe_sample(sample, output)

    def observe_unfinished(self, output: Any | None, reason: str, num_samples: int) -> None:
        """A request that ended without a finished output reaching the server: "abort" (its client left first)
        or "error" (the engine failed under it). Its samples that had finished in `output` (the last output
        the server read, if any) count as they finished; the others count under `reason`."""
        done = [c for c in output.outputs if c.finished] if output is not None else []
        for sample in done:
            self._observe_sample(sample, output)
        if num_samples > len(done):
            self.request_success[reason].inc(num_samples - len(done))

    def _observe_sample(self, sample: Any, output: Any) -> None:
        """One finished sample: its reason, token counts and phase times (its own metrics where the engine gave
        them, else the request's; a phase it never reached, such as the decode of a request aborted while
        queued, is None)."""
        m = sample.metrics or output.metrics
        reason = sample.finish_reason
        self.request_success[reason if reason in self.request_success else "error"].inc()
        num_generated = len(sample.token_ids)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_generated)
        for hist, value in ((self.e2e_latency, m.e2e_time), (self.queue_time, m.queue_time),
                            (self.prefill_time, m.prefill_time), (self.decode_time, m.decode_time),
                            (self.time_to_first_token, m.time_to_first_token)):
            if value is not None:
                hist.observe(_nonneg(value))
        if m.prefill_time is not None and m.decode_time is not None:
            self.inference_time.observe(_nonneg(m.prefill_time + m.decode_time))
        if num_generated > 1 and m.decode_time is not None:
            self.time_per_output_token.observe(_nonneg(m.decode_time) / (num_generated - 1))

    def observe_token_times(self, times: Sequence[float]) -> None:
        """Inter-token latencies: the gaps between consecutive token times of one request (seconds)."""
        for a, b in zip(times, times[1:]):
            self.inter_token_latency.observe(_nonneg(b - a))

    def update_from_stats(self, stats: Any) -> None:
        """Gauges from an EngineStats snapshot; counters advanced by the engine totals' growth since the
        last call."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_usage)
        self.num_requests_swapped.set(stats.num_swapped)
        self.swap_blocks_in_use.set(stats.swap_blocks_used)
        self.iteration_tokens.snapshot = stats.iteration_tokens
        totals = {
            "prompt_tokens": (self.prompt_tokens, stats.prompt_tokens),
            "generation_tokens": (self.generation_tokens, stats.generation_tokens),
            "num_preemptions": (self.num_preemptions, stats.num_preemptions_total),
            "prefix_cache_queries": (self.prefix_cache_queries, stats.prefix_cache_queries),
            "prefix_cache_hits": (self.prefix_cache_hits, stats.prefix_cache_hits),
            "num_finished": (self.engine_finished, stats.num_finished),
            "spec_drafts": (self.spec_drafts, stats.spec.num_drafts),
            "spec_draft_tokens": (self.spec_draft_tokens, stats.spec.num_draft_tokens),
            "spec_accepted_tokens": (self.spec_accepted_tokens, stats.spec.num_accepted_tokens),
        }
        for pos, total in enumerate(stats.spec.accepted_per_position):
            totals[f"spec_pos_{pos}"] = (self._spec_per_position.labels(**self._labels, position=str(pos)), total)
        with self._lock:
            for key, (counter, total) in totals.items():
                delta = counter_delta(total, self._engine_totals.get(key, 0))
                self._engine_totals[key] = total
                if delta:
                    counter.inc(delta)

    def set_model_weights_bytes(self, num_bytes: int) -> None:
        self.weights_bytes = num_bytes
        self.model_weights_bytes.set(num_bytes)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler=handler, method=method, status=str(status)).inc()
        self.http_latency.labels(handler=handler, method=method).observe(_nonneg(seconds))

    def observe_rejected(self, reason: str) -> None:
        if reason not in self.requests_rejected:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {', '.join(REJECT_REASONS)}")
        self.requests_rejected[reason].inc()

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4; serve it with CONTENT_TYPE)."""
        return generate_latest(self.registry)


def _nonneg(seconds: float) -> float:
    # Monotonic differences are never negative; a clock read out of order by a thread switch can be -1e-7.
    return max(0.0, seconds)


class EngineHistogram(Collector):
    """A histogram the engine keeps (bucket counts, sum; quantkit.engine.stats.Histogram), exported as a
    Prometheus histogram as of the last `update_from_stats`."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], bounds: Sequence[float]):
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, tuple(bounds)
        self.snapshot = None  # the engine's Histogram; None until the first stats arrive

    def collect(self):
        counts = self.snapshot.counts if self.snapshot is not None else [0] * (len(self.bounds) + 1)
        if tuple(self.snapshot.bounds if self.snapshot is not None else self.bounds) != self.bounds:
            raise ValueError(f"{self.name}: the engine's buckets differ from {self.bounds}")
        cumulative, buckets = 0, []
        for bound, n in zip((*map(float, self.bounds), float("inf")), counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets,
                          sum_value=self.snapshot.sum if self.snapshot is not None else 0.0)
        yield family


class TokenClock:
    """Token times of one request from its cumulative outputs: the engine's `last_token_time` each time
    the token count grows. When one output brings k > 1 new tokens (the reader fell behind), their
    times are spread evenly since the previous one. Holds one request's times: bounded by max_tokens."""

    def __init__(self):
        self.times: list[float] = []
        self._tokens = 0

    def update(self, output: Any) -> None:
        last = output.metrics.last_token_time
        n = sum(len(c.token_ids) for c in output.outputs)
        if n <= self._tokens or last is None:
            return
        prev = self.times[-1] if self.times else None
        k = n - self._tokens
        if prev is None:
            self.times.append(last)  # the first token; more that came with it get the same time
            prev, k = last, k - 1
        self.times.extend(prev + (last - prev) * (j + 1) / k for j in range(k))
        self._tokens = n
