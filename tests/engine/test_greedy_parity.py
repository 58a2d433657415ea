"""Greedy outputs of the engine, token for token, against transformers' generate (fp32, CPU); in bf16,
within near-ties of the fp32 logits.

32 prompts of different lengths (half of them sharing a 24-token prefix) run together; the
reference runs them one at a time through HF `generate`. The same outputs must come out with a
pool so small that requests are preempted many times (by recompute and by swap), with chunked
prefill forced by a small token budget, and with prefix caching on and off.
"""

from __future__ import annotations

import math

import pytest
import torch

from quantkit.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

MAX_TOKENS = 16


def make_prompts(vocab: int, n: int = 32, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()
    prompts = []
    for i in range(n):
        length = 1 + (11 * i) % 57
        tail = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompts.append([1] + (shared + tail if i % 2 else tail))
    return prompts


def hf_greedy(path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


def engine_greedy(path, prompts, dtype: str = "float32", **kw) -> tuple[list[list[int]], object]:
    llm = LLM(str(path), dtype=dtype, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


@pytest.fixture(scope="module")
def stories_case(stories_dir):
    prompts = make_prompts(512)
    return stories_dir, prompts, hf_greedy(stories_dir, prompts)


def test_stories_greedy_matches_transformers(stories_case):
    path, prompts, want = stories_case
    got, stats = engine_greedy(path, prompts, max_num_seqs=32, max_model_len=256)
    assert got == want
    assert stats.num_preemptions_total == 0 and stats.prefix_cache_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize("swap_space", [0.0, 0.002], ids=["recompute", "swap"])
def test_stories_same_outputs_when_preempted_many_times(stories_case, swap_space):
    path, prompts, want = stories_case
    # 128-token requests need 8 blocks; 9 blocks hold barely two of the 32 requests at a time.
    got, stats = engine_greedy(path, prompts, max_num_seqs=32, max_model_len=128, num_kv_blocks=9,
                               swap_space=swap_space)
    assert got == want
    assert stats.num_preemptions_total >= 10
    assert (stats.num_swap_outs > 0) == (swap_space > 0)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_stories_same_outputs_with_chunked_prefill(stories_case, caching):
    path, prompts, want = stories_case
    got, stats = engine_greedy(path, prompts, max_num_seqs=32, max_model_len=256, max_num_batched_tokens=16,
                               enable_prefix_caching=caching)
    assert got == want
    assert (stats.prefix_cache_hits > 0) == caching


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_tiny_families_greedy_match_transformers(family, request):
    path = request.getfixturevalue(family)
    prompts = make_prompts(512, seed=1)
    want = hf_greedy(path, prompts)
    got, _ = engine_greedy(path, prompts, max_num_seqs=32, max_model_len=256, max_num_batched_tokens=64)
    assert got == want


NEAR_TIE_BF16_ULPS = 2  # a bf16 token may differ from fp32's where its fp32 logit is this close to the argmax's


def near_tie(top_logit: float) -> float:
    """Two bf16 ulps at the top logit's magnitude: the engine's bf16 logits are rounded to 8 significant
    bits (ulp 0.0625 for a logit of 8-16), so two logits within an ulp can swap from rounding alone, and
    oneDNN's bf16 kernels (which differ between AVX2, AVX-512 and AMX machines) add their own error."""
    return NEAR_TIE_BF16_ULPS * 2.0 ** (math.floor(math.log2(abs(top_logit))) - 7)


def assert_within_near_ties(path, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]) -> int:
    """Each bf16 output equals the fp32 one up to its first differing token, where the bf16 token's fp32
    logit (on the same prefix) is within `near_tie` of the fp32 argmax; returns how many outputs differ."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    differ = 0
    for p, g, w in zip(prompts, got, want):
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if i is None:
            assert g == w
            continue
        differ += 1
        with torch.no_grad():
            logits = model(torch.tensor([p + g[:i]])).logits[0, -1]  # [vocab] fp32
        top = float(logits.max())
        assert top - logits[g[i]] <= near_tie(top), (p, i, float(top - logits[g[i]]), near_tie(top))
    return differ


def test_stories_bf16_greedy_within_near_ties_of_fp32(stories_case):
    path, prompts, want = stories_case
    got, _ = engine_greedy(path, prompts, dtype="bfloat16", max_num_seqs=32, max_model_len=256)
    assert len(got) == len(want) and all(len(g) == MAX_TOKENS for g in got)
    assert assert_within_near_ties(path, prompts, got, want) < len(prompts) // 2
