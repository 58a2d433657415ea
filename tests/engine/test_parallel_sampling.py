"""n > 1 on stories260K: samples share the prompt's KV blocks, seeds derive per sample (reproducible),
outputs are gathered with indices 0..n-1, and an abort ends every sample."""

from __future__ import annotations

import pytest

from quantkit.engine import LLM, SamplingParams

PROMPT = [1] + list(range(20, 59))  # 40 tokens: 2 full blocks of 16 and 8 more


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=8, max_model_len=128)


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_seeded_samples_are_reproducible_and_derive_seed_plus_index(llm):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=3, ignore_eos=True)
    first, again = llm.generate(PROMPT, p)[0], llm.generate(PROMPT, p)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2] and tokens(first) == tokens(again)
    singles = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12,
                                                   ignore_eos=True))[0].outputs[0].token_ids for i in range(3)]
    assert tokens(first) == singles and len({tuple(t) for t in singles}) == 3
    assert first.finished and first.metrics.num_generation_tokens == 36
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, n=2))[0]
    assert tokens(greedy)[0] == tokens(greedy)[1]


def test_samples_share_the_prompt_blocks(stories_dir):
    llm = LLM(str(stories_dir), max_num_seqs=8, max_model_len=128)
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=4, n=3))
    eng.step()
    ids = [eng.kv.block_ids(f"{i}_{rid}") for i in range(3)]
    assert ids[0][:2] == ids[1][:2] == ids[2][:2]  # the two full prompt blocks, held three times
    assert [eng.kv.pool.blocks[b].ref_cnt for b in ids[0][:2]] == [3, 3]
    assert len({i[2] for i in ids}) == 3  # each sample writes its own partial block
    st = eng.get_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (3 * 40, 2 * 32)
    assert eng.abort_request(rid)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    out = eng.step()
    assert len(out) == 1 and [c.finish_reason for c in out[0].outputs] == ["abort"] * 3 and out[0].finished
