"""Sampled and prompt logprobs against a direct log-softmax of transformers' logits (both fp32), and the
output-token penalties and min_tokens against a reference greedy loop over the same logits."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.logprobs import logprob_dicts

PROMPT = [1] + list(range(30, 69))  # 40 tokens


@pytest.fixture(scope="module")
def hf(stories_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32).eval()


def log_softmax_of(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-distribution of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprob_dicts_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    d = logprob_dicts(logits, [2], [2], str)[0]
    lp = torch.log_softmax(logits[0], dim=-1)
    assert list(d) == [2, 1, 3]  # the sampled token first, then the top 2
    assert d[2].rank == 3 and d[2].logprob == pytest.approx(float(lp[2])) and d[2].decoded_token == "2"
    assert {d[1].rank, d[3].rank} == {1, 2}
    assert list(logprob_dicts(logits, [1], [0], str)[0]) == [1]
    many = torch.randn(600, 4)  # more rows than one pass: the same dicts as row by row
    toks = torch.randint(0, 4, (600,)).tolist()
    assert logprob_dicts(many, toks, [2] * 600, str) == [logprob_dicts(many[r:r + 1], toks[r:r + 1], [2], str)[0]
                                                         for r in range(600)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_logprobs_match_the_log_softmax(stories_dir, hf, temperature):
    llm = LLM(str(stories_dir), max_model_len=128, dtype="float32")
    p = SamplingParams(temperature=temperature, seed=3, max_tokens=10, logprobs=5, ignore_eos=True)
    out = llm.generate(PROMPT, p)[0].outputs[0]
    ref = log_softmax_of(hf, PROMPT + out.token_ids)[len(PROMPT) - 1:-1]  # [10, V]
    assert len(out.logprobs) == 10
    total = 0.0
    for row, tok, d in zip(ref, out.token_ids, out.logprobs):
        assert d[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(5)
        assert list(d)[0] == tok and set(d) == {tok} | set(top.indices.tolist())  # sampled first, then the top
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert d[t].logprob == pytest.approx(v, abs=1e-4) and d[t].rank == rank
        assert d[tok].decoded_token == llm.tokenizer.decode([tok])
        total += d[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    if temperature == 0:
        assert all(d[t].rank == 1 for t, d in zip(out.token_ids, out.logprobs))
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_prompt_logprobs_with_chunked_prefill_and_a_warm_prefix_cache(stories_dir, hf):
    llm = LLM(str(stories_dir), max_model_len=128, max_num_batched_tokens=16, dtype="float32")
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))  # caches the prompt's blocks
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2))[0]
    ref = log_softmax_of(hf, PROMPT)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        d, row = out.prompt_logprobs[i], ref[i - 1]
        assert d[PROMPT[i]].logprob == pytest.approx(float(row[PROMPT[i]]), abs=1e-4)
        assert set(row.topk(2).indices.tolist()) <= set(d) and len(d) <= 3


def reference_greedy(hf, prompt: list[int], n: int, presence: float, frequency: float, banned_before: int,
                     banned: set[int]) -> list[int]:
    """Greedy over transformers' logits with OpenAI penalties on the output tokens and banned ids early."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - presence * (counts > 0).float() - frequency * counts
        if len(out) < banned_before:
            logits[list(banned)] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_match_a_reference_greedy(stories_dir, hf):
    llm = LLM(str(stories_dir), max_model_len=128, dtype="float32")
    prompt = llm.tokenizer("Once upon a time").input_ids
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0)
    got = llm.generate(prompt, p)[0].outputs[0].token_ids
    assert got == reference_greedy(hf, prompt, 40, 1.5, 1.0, 0, set()) and got != plain.token_ids


def test_min_tokens_holds_back_stop_ids_and_eos(stories_dir, hf):
    llm = LLM(str(stories_dir), max_model_len=128, dtype="float32")
    prompt = llm.tokenizer("Once upon a time").input_ids
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop = free.token_ids[3]
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0].outputs[0]
    assert len(early.token_ids) == free.token_ids.index(stop) + 1  # without min_tokens it stops there
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop],
                                               min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:8]
    banned = {stop} | set(llm.engine.eos_ids)
    assert held.token_ids == reference_greedy(hf, prompt, len(held.token_ids), 0, 0, 8, banned)
