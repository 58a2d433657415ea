"""LLMEngine as a server drives it: an output for every request that changed, cumulative outputs,
per-request timestamps, and abort from every state with exact block bookkeeping (stories260K)."""

from __future__ import annotations

from collections import Counter

import pytest

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.request import RequestStatus
from quantkit.errors import QuantkitError

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompt(n: int, base: int = 10) -> list[int]:
    return [1] + list(range(base, base + n - 1))


def assert_blocks_exact(eng) -> None:
    """Every KV block's reference count equals the number of live requests holding it; free blocks
    are exactly those at 0; swap blocks in use are exactly those of swapped-out requests."""
    kv = eng.kv
    held = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    assert [b.ref_cnt for b in kv.pool.blocks] == [held.get(i, 0) for i in range(kv.pool.num_blocks)]
    assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    if eng.swap is not None:
        swapped = sum(len(r.swapped_blocks or ()) for r in eng.scheduler.waiting)
        assert eng.swap.num_free == eng.swap.num_blocks - swapped


def assert_all_free(eng) -> None:
    assert_blocks_exact(eng)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.kv.req_blocks
    assert eng.swap is None or eng.swap.num_free == eng.swap.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=2, max_model_len=128, max_num_batched_tokens=16)


def test_step_returns_cumulative_outputs_for_every_changed_request(llm):
    eng = llm.engine
    a = eng.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=5))
    b = eng.add_request(prompt(5), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen: dict[str, list] = {a: [], b: []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    for rid, n in ((a, 5), (b, 3)):
        outs = seen[rid]
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, n + 1))  # one per new token
        assert all(o.outputs[0].token_ids[:-1] == p.outputs[0].token_ids for p, o in zip(outs, outs[1:]))
        assert all(o.outputs[0].text.startswith(p.outputs[0].text) for p, o in zip(outs, outs[1:]))
        assert [o.finished for o in outs] == [False] * (n - 1) + [True]
        # the prompt's ids are one list for all of a request's outputs: a step copies nothing the length of the prompt
        assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
        assert outs[-1].outputs[0].finish_reason == "length" and outs[-2].outputs[0].finish_reason is None
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.num_generation_tokens == n and m.num_prompt_tokens == len(outs[-1].prompt_token_ids)
        assert min(m.queue_time, m.prefill_time, m.decode_time) >= 0
        assert m.e2e_time == pytest.approx(m.queue_time + m.prefill_time + m.decode_time)
        assert m.time_to_first_token == pytest.approx(m.queue_time + m.prefill_time)
    assert_all_free(eng)


def test_generate_is_unchanged_and_ids_are_unique(llm):
    outs = llm.generate(["Once upon a time", "The dog"], SamplingParams(temperature=0, max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4] and all(o.finished for o in outs)
    eng = llm.engine
    eng.add_request("x", LONG, request_id="dup")
    with pytest.raises(QuantkitError, match="request id 'dup' is already in use"):
        eng.add_request("y", LONG, request_id="dup")
    assert eng.abort_request("dup") and not eng.abort_request("dup") and not eng.abort_request("nope")
    assert [(o.request_id, o.outputs[0].finish_reason, o.finished) for o in eng.step()] == [("dup", "abort", True)]
    assert not eng.has_unfinished_requests()


def abort_exact(eng, rid: str) -> None:
    """Abort, then check the bookkeeping within the call, before any step."""
    assert eng.abort_request(rid)
    assert_blocks_exact(eng)
    assert rid not in {r.request_id for r in eng.scheduler.running + list(eng.scheduler.waiting)}
    assert rid not in eng.kv.req_blocks


def abort_and_check(eng, rid: str) -> None:
    abort_exact(eng, rid)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[rid].finished and outs[rid].outputs[0].finish_reason == "abort"


def test_abort_while_waiting_prefilling_and_decoding(llm):
    eng = llm.engine
    dec = eng.add_request(prompt(6), LONG)
    pre = eng.add_request(prompt(60, base=100), LONG)  # 60 tokens under a 16-token budget: 4+ steps of prefill
    wait = eng.add_request(prompt(8, base=300), LONG)  # max_num_seqs=2: waits
    eng.step()
    eng.step()
    statuses = {r.request_id: (r.status, r.num_computed_tokens) for r in eng.scheduler.running}
    assert statuses[dec][0] == RequestStatus.RUNNING and statuses[dec][1] > 6  # decoding
    assert 0 < statuses[pre][1] < 60  # prefilling, holding blocks
    assert [r.request_id for r in eng.scheduler.waiting] == [wait]
    abort_and_check(eng, wait)
    held_by_pre = len(eng.kv.req_blocks[pre])
    free = eng.kv.num_free_blocks
    assert eng.abort_request(pre) and eng.kv.num_free_blocks == free + held_by_pre
    assert_blocks_exact(eng)
    eng.step()
    abort_and_check(eng, dec)
    assert_all_free(eng)


@pytest.mark.parametrize("swap_space", [0.0, 0.001])
def test_abort_preempted_and_swapped_requests_frees_every_block(stories_dir, swap_space):
    llm = LLM(str(stories_dir), max_num_seqs=4, max_model_len=64, num_kv_blocks=6, swap_space=swap_space)
    eng = llm.engine
    ids = [eng.add_request(prompt(20, base=10 + 40 * i), LONG) for i in range(4)]
    victim = None
    for _ in range(200):
        eng.step()
        victim = next((r for r in eng.scheduler.waiting if r.status == RequestStatus.PREEMPTED), None)
        if victim is not None:
            break
    assert victim is not None, "the small pool never preempted"
    assert (victim.swapped_blocks is not None) == (swap_space > 0)
    st = eng.get_stats()
    assert st.num_preempted >= 1 and st.num_swapped == (swap_space > 0)
    assert st.swap_blocks_used == len(victim.swapped_blocks or ()) and st.num_preemptions_total >= 1
    swap_free = eng.swap.num_free if eng.swap is not None else 0
    swapped = len(victim.swapped_blocks or ())
    abort_exact(eng, victim.request_id)
    if eng.swap is not None:
        assert eng.swap.num_free == swap_free + swapped
    assert {o.request_id: o for o in eng.step()}[victim.request_id].outputs[0].finish_reason == "abort"
    for rid in ids:
        eng.abort_request(rid)
    assert_all_free(eng)
    outs = eng.step()
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished_requests()
    st = eng.get_stats()
    assert st.finished_by_reason["abort"] == 4 and st.num_preemptions_total >= 1
    assert st.kv_blocks_free == st.kv_blocks_total and st.swap_blocks_used == 0


def test_streamed_text_never_shrinks_when_a_stop_string_cuts_it(llm):
    eng = llm.engine
    free = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "Lily" in free.text
    rid = eng.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily."]))
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step() if o.request_id == rid]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == free.text[:free.text.index("Lily.")]


def test_finished_requests_leave_no_per_request_state(llm):
    eng = llm.engine
    llm.generate(["Once upon a time"] * 3, SamplingParams(temperature=0.8, max_tokens=6, n=2, logprobs=2))
    rid = eng.add_request("The dog", SamplingParams(max_tokens=50, seed=1))
    eng.step()
    eng.abort_request(rid)
    eng.step()
    assert not (eng._groups or eng._group_of or eng._detoks or eng._changed or eng.sampler._generators)
    assert not (eng.kv.req_blocks or eng.kv.num_cached_blocks)
    assert_all_free(eng)
