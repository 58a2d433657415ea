"""Sampler math with exact expectations, SamplingParams validation, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    sample_row,
)
from quantkit.engine.sampling_params import SamplingParams
from quantkit.errors import QuantkitError

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != NEG]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, 4.0])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 4.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 4.0]  # not modified in place


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = apply_presence_frequency(logits, [0, 2, 2, 2], presence=0.5, frequency=0.25)
    assert out.tolist() == [1.0 - 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.75, 1.0]
    assert apply_presence_frequency(logits, [1], presence=-1.0, frequency=0.0).tolist() == [1.0, 2.0, 1.0, 1.0]
    assert apply_presence_frequency(logits, [], 2.0, 2.0) is logits


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    s = Sampler(seed=0, eos_ids=frozenset({2}))
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sorted(s.banned_ids(p, 0)) == [1, 2] and s.banned_ids(p, 2) == ()
    assert s.banned_ids(SamplingParams(min_tokens=2, ignore_eos=True, max_tokens=4), 1) == ()
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]])
    assert s.sample(logits, ["a"], [p], [[]], [[]]) == [3]  # EOS (2) and the stop id (1) masked
    assert s.sample(logits, ["a"], [p], [[5, 5]], [[5, 5]]) == [2]
    huge = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[10**6])  # outside the vocabulary
    assert s.sample(logits, ["a"], [huge], [[]], [[]]) == [1]  # EOS masked, the bad id ignored


def test_top_k_keeps_the_k_largest():
    assert kept(apply_top_k(torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5]), 2)) == [1, 4]
    assert kept(apply_top_k(torch.tensor([1.0, 2.0]), 0)) == [0, 1]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.05, 0.3, 0.15])
    logits = probs.log()
    assert kept(apply_top_p(logits, 0.5)) == [0]
    assert kept(apply_top_p(logits, 0.6)) == [0, 2]
    assert kept(apply_top_p(logits, 0.85)) == [0, 2, 3]
    assert kept(apply_top_p(logits, 0.01)) == [0]  # at least one token
    assert kept(apply_top_p(logits, 1.0)) == [0, 1, 2, 3]


def test_min_p_is_relative_to_the_top_token():
    logits = torch.tensor([0.5, 0.05, 0.3, 0.15]).log()
    assert kept(apply_min_p(logits, 0.5)) == [0, 2]  # 0.5 * 0.5 = 0.25


def test_greedy_row_and_temperature_draws_follow_the_generator():
    logits = torch.tensor([0.0, 1.0, 0.5])
    assert sample_row(logits, SamplingParams(temperature=0), [], None) == 1
    p = SamplingParams(temperature=1.0, seed=3)
    draws = [sample_row(logits, p, [], torch.Generator().manual_seed(3)) for _ in range(3)]
    assert len(set(draws)) == 1
    # a near-zero top_p leaves only the argmax, whatever the generator
    assert all(sample_row(logits, SamplingParams(temperature=2.0, top_p=1e-6), [], torch.Generator().manual_seed(s))
               == 1 for s in range(5))


def test_temperature_draw_frequencies_match_the_softmax():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = 0.25, 0.75
    gen = torch.Generator().manual_seed(0)
    draws = [sample_row(logits, SamplingParams(temperature=1.0), [], gen) for _ in range(4000)]
    assert abs(sum(draws) / 4000 - 0.75) < 0.03


def test_sampler_batches_greedy_rows_and_keeps_per_request_generators():
    s = Sampler(seed=0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    out = s.sample(logits, ["a", "b"], [SamplingParams(temperature=0), SamplingParams(temperature=0)], [[], []])
    assert out == [1, 0]
    g1 = s.generator("c", SamplingParams(seed=11))
    assert s.generator("c", SamplingParams(seed=11)) is g1
    s.release("c")
    assert s.generator("c", SamplingParams(seed=11)) is not g1


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n must be at least 1"),
    ({"logprobs": -1}, "logprobs must be at least 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
    ({"stop": [""]}, "stop strings"),
])
def test_invalid_sampling_values_are_refused(kwargs, match):
    with pytest.raises(QuantkitError, match=match):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1e-308), dict(temperature=1e-38, top_p=0.9)])
def test_overflowing_penalties_and_temperatures_still_draw_the_top_tokens(kwargs):
    """A tiny repetition penalty or temperature sends logits to +inf (found by the server's fuzz test): the draw
    must still pick among the largest, never fail on nan probabilities."""
    logits = torch.tensor([2.0, 5.0, 5.0, -1.0, 0.5])
    params = SamplingParams(**{"temperature": 1.0, **kwargs})
    seen = [1, 2, 3] if "repetition_penalty" in kwargs else []
    picks = {sample_row(logits, params, seen, torch.Generator().manual_seed(s)) for s in range(20)}
    assert picks <= {1, 2} and picks


def test_logit_bias_is_added_before_everything_else():
    from quantkit.engine.sampler import apply_logit_bias

    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    assert torch.equal(apply_logit_bias(logits, [(0, 5.0), (3, -1.0), (9, 100.0)]), torch.tensor([6.0, 2.0, 3.0, -0.5]))
    params = SamplingParams(temperature=0, logit_bias={"1": 100})  # keys as OpenAI's JSON writes them
    assert params.logit_bias == ((1, 100.0),)
    assert Sampler().sample(logits[None], ["r"], [params], [[0]]) == [1]  # greedy rows see the bias too
    with pytest.raises(QuantkitError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
