"""Speculative decoding by n-gram prompt lookup (quantkit.engine.spec_decode): the proposer, the verification rules
against the distributions they must keep, and the engine's outputs with and without it."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.sampler import Sampler
from quantkit.engine.spec_decode import (NgramIndex, SpeculativeConfig, accept_or_resample, propose_ngram,
                                         verify_greedy)
from quantkit.errors import QuantkitError


@pytest.mark.parametrize("tokens,k,n_max,want", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 3, [4, 1, 2]),  # "1 2 3" seen before: what followed it
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, [4]),
    ([5, 9, 5, 7, 5], 2, 2, [7, 5]),  # the latest earlier occurrence of "5" (followed by 7), not the first
    ([1, 2, 3, 4], 3, 3, []),  # nothing recurs
    ([7, 7], 4, 2, [7]),  # as far as the tokens go
    ([1, 2, 9, 1, 2], 2, 4, [9, 1]),  # longest n first: "1 2" at n = 2
])
def test_the_proposer_follows_the_latest_earlier_longest_suffix(tokens, k, n_max, want):
    assert propose_ngram(tokens, k, n_max) == want


def test_greedy_verification_keeps_agreement_then_the_targets_token():
    assert verify_greedy([4, 1, 2, 8], [4, 1, 2]) == [4, 1, 2, 8]  # all kept, plus the bonus
    assert verify_greedy([4, 6, 2, 8], [4, 1, 2]) == [4, 6]  # the first disagreement ends it
    assert verify_greedy([5, 1, 2, 8], [4, 1, 2]) == [5]


def test_rejection_sampling_of_a_fixed_draft_is_the_target_distribution():
    """Over many draws, the token out of accept_or_resample is distributed as p, whatever the draft."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    gen = torch.Generator().manual_seed(0)
    draws = 20000
    for draft in (0, 3):
        counts = torch.zeros(5)
        for _ in range(draws):
            token, _ = accept_or_resample(p, draft, gen)
            counts[token] += 1
        chi2 = float(((counts - draws * p) ** 2 / (draws * p)).sum())
        assert chi2 < 20.5, (draft, counts / draws)  # 4 degrees of freedom: p < 0.0005 of a false failure


def test_the_sampler_verifies_in_order_with_penalties_seeing_the_kept_drafts():
    """Greedy with a repetition penalty: at the second position the first draft is already output, so its logit is
    penalised there as in plain decoding."""
    s = Sampler(seed=0)
    params = SamplingParams(temperature=0, repetition_penalty=100.0)
    logits = torch.full((3, 6), -1.0)
    logits[0, 2] = 5.0  # position 0 wants 2
    logits[1, 2], logits[1, 4] = 5.0, 4.0  # position 1 also prefers 2, but 2 is now seen: 4 wins
    logits[2, 1] = 3.0
    assert s.verify(logits, "r", params, [0], [], drafts=[2, 2]) == [2, 4]


@pytest.mark.parametrize("d,words", [({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                                     ({"num_speculative_tokens": 0}, "at least 1"), ({}, "required"),
                                     ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
                                      "prompt_lookup_min"),
                                     ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys")])
def test_a_bad_speculative_config_is_one_line(d, words):
    with pytest.raises(QuantkitError, match=words):
        SpeculativeConfig.from_dict(d)


@pytest.mark.parametrize("n_max,n_min", [(4, 1), (4, 4), (2, 1), (5, 3)])
def test_the_index_drafts_as_the_reference_scan(n_max, n_min):
    """NgramIndex, fed a list as it grows (a few tokens at a time, as accepted drafts arrive), drafts at every length
    what propose_ngram's scan of the whole list drafts; a list that shrinks starts it afresh."""
    g = torch.Generator().manual_seed(n_max * 10 + n_min)
    for vocab in (3, 8, 50):
        tokens = torch.randint(0, vocab, (300,), generator=g).tolist()
        index, length = NgramIndex(n_max, n_min), 0
        while length < len(tokens):
            length += int(torch.randint(1, 4, (1,), generator=g))
            assert index.propose(tokens[:length], 4) == propose_ngram(tokens[:length], 4, n_max, n_min), length
        other = torch.randint(0, vocab, (40,), generator=g).tolist()
        assert index.propose(other, 3) == propose_ngram(other, 3, n_max, n_min)


@pytest.mark.parametrize("d,window", [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)),
                                      ({"prompt_lookup_min": 2}, (2, 2)),
                                      ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (4, 1))])
def test_the_lookup_window_defaults_as_vllms(d, window):
    cfg = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, **d})
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == window


def test_a_zero_lookup_bound_is_refused_not_defaulted():
    with pytest.raises(QuantkitError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 0, "prompt_lookup_max": 3})


REPEATING = ["Once upon a time there was a little girl named Lily. She loved to play with her toys. One day, Lily went "
             "to the park. Once upon a time there was a little girl named Lily. She loved to play",
             "Tom had a big red ball. Tom had a big red ball. Tom had a big red ball. Tom had"]


@pytest.fixture(scope="module")
def engines(stories_dir):
    common = dict(max_model_len=256, max_num_seqs=8, dtype="float32")
    return (LLM(str(stories_dir), **common),
            LLM(str(stories_dir), speculative_config={"num_speculative_tokens": 4, "prompt_lookup_max": 3}, **common))


def test_greedy_outputs_and_logprobs_are_the_same_with_and_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=2)
    prompts = REPEATING * 3 + ["The little dog"]
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids and x.outputs[0].text == y.outputs[0].text
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-3 for t in lx)
    stats = spec.engine.get_stats().spec
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_stops_and_max_tokens_hold_inside_accepted_drafts(engines):
    plain, spec = engines
    for params in (SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=60,
                                                                             stop=["park"])):
        a, b = plain.generate(REPEATING, params), spec.generate(REPEATING, params)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in a] == \
            [(o.outputs[0].text, o.outputs[0].finish_reason) for o in b]


def test_greedy_stays_identical_when_requests_are_preempted(stories_dir):
    common = dict(max_model_len=128, max_num_seqs=8, dtype="float32", num_kv_blocks=9)
    plain = LLM(str(stories_dir), **common)
    spec = LLM(str(stories_dir), speculative_config={"num_speculative_tokens": 3}, **common)
    params = SamplingParams(temperature=0, max_tokens=50)
    prompts = [REPEATING[1]] * 6
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert spec.engine.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_sampled_token_frequencies_match_without_speculation(engines):
    """Seeded sampling is not token for token the same (the draws differ), but the distribution is: per prompt and
    output position, the tokens of 128 samples with speculation are as far from those of 128 without it as two runs
    without it on other seeds are from each other (total variation; a draft always kept, say, lands far above)."""
    plain, spec = engines

    def freqs(llm, seed):
        counts: dict[tuple, int] = {}
        for i, out in enumerate(llm.generate(REPEATING, SamplingParams(temperature=1.0, n=128, seed=seed,
                                                                       max_tokens=6))):
            for c in out.outputs:
                for pos, t in enumerate(c.token_ids[1:6], 1):  # position 0 comes from the prefill: no drafts yet
                    counts[(i, pos, t)] = counts.get((i, pos, t), 0) + 1
        total = sum(counts.values())
        return {k: n / total for k, n in counts.items()}

    def tv(a, b):
        return 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b))

    a, b, c = freqs(plain, 1), freqs(plain, 5000), freqs(spec, 10000)  # seeds far apart: independent children
    assert tv(a, c) < 1.25 * tv(a, b) + 0.02, (tv(a, c), tv(a, b))
    assert spec.engine.get_stats().spec.num_accepted_tokens > 0
