"""The bookkeeping benchmark's measurement on small cases: both ways timed, the sequences decoding."""

from __future__ import annotations

from step_bookkeeping import Case, make_scheduler, measure, step


def test_measure_times_both_ways():
    r = measure(Case(batch=4, length=40, shared=16), rounds=2, steps=3)
    assert set(r) == {"kept", "lists"} and min(r.values()) > 0


def test_the_steps_decode_every_sequence_on_the_shared_prefix():
    s = make_scheduler(Case(batch=3, length=40, shared=32))
    step(s, kept=True)  # the prefill (the first request computes the prefix; the others hit it or share the step)
    for kept in (True, False):
        step(s, kept)
    assert [r.num_computed_tokens for r in s.running] == [42, 42, 42]
    assert len({tuple(s.kv.block_ids(r.request_id)[:2]) for r in s.running}) == 1  # the two prefix blocks, shared
