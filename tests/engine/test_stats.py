"""Bounded engine statistics: fixed-bucket histograms with Prometheus' `le` semantics, and counters."""

from __future__ import annotations

import pytest

from quantkit.engine.request import Request
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.stats import Histogram, StatsCollector


def test_histogram_counts_each_value_in_the_first_bucket_at_or_above_it():
    h = Histogram(bounds=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 7.0):
        h.observe(v)
    assert h.counts == [2, 2, 2] and h.count == 6 and h.sum == pytest.approx(11.65)
    snap = h.copy()
    h.observe(0.0)
    assert snap.counts == [2, 2, 2] and h.counts == [3, 2, 2]


def test_collector_stays_the_same_size_however_many_requests_it_sees():
    c = StatsCollector()
    for i in range(1000):
        req = Request(str(i), [1, 2, 3], SamplingParams(), 4, arrival_time=0.0)
        for t in range(3):
            c.on_token(req, 0.01 * (t + 1))
            req.append_token(5, 0.01 * (t + 1))
        req.finish_reason = ("stop", "length", "abort")[i % 3]
        req.metrics.finished_time = 0.05
        c.on_finished(req)
    assert (c.prompt_tokens, c.generation_tokens, c.num_finished) == (3000, 3000, 1000)
    assert c.finished_by_reason == {"stop": 334, "length": 333, "abort": 333, "error": 0}
    assert (c.ttft.count, c.itl.count, c.e2e.count) == (1000, 2000, 1000)
    assert c.itl.mean == pytest.approx(0.01) and len(c.ttft.counts) == len(c.ttft.bounds) + 1
    assert not [v for v in vars(c).values() if isinstance(v, list)]
