"""Scheduler bookkeeping with exact expectations: token budget, chunked prefill, FCFS, max_num_seqs,
preemption of the newest request by recompute and by swap. No model: a fake step appends token 7."""

from __future__ import annotations

from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.request import Request, RequestStatus
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.scheduler import Scheduler, SchedulerOutput
from quantkit.engine.swap import SwapSpace

BS = 4


def make(rid: str, n: int, base: int = 0) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=100), BS)


def step(s: Scheduler) -> SchedulerOutput:
    """schedule, 'run', advance, and append a sampled token to each request whose chunk samples."""
    out = s.schedule()
    s.update_from_output(out)
    for c in out.chunks:
        if c.samples:
            c.request.append_token(7, 0.0)
    return out


def tokens(out: SchedulerOutput) -> dict[str, int]:
    return {c.request.request_id: c.num_tokens for c in out.chunks}


def test_long_prompt_is_prefilled_in_chunks_and_samples_once():
    s = Scheduler(KVCacheManager(20, BS), max_num_seqs=4, max_num_batched_tokens=8)
    r = make("a", 20)
    s.add_request(r)
    outs = [step(s) for _ in range(3)]
    assert [tokens(o) for o in outs] == [{"a": 8}, {"a": 8}, {"a": 4}]
    assert [[c.samples for c in o.chunks] for o in outs] == [[False], [False], [True]]
    assert [c.start for o in outs for c in o.chunks] == [0, 8, 16]
    assert r.output_token_ids == [7] and r.num_computed_tokens == 20
    assert tokens(step(s)) == {"a": 1}  # then one token per step


def test_decodes_run_beside_a_chunked_prefill_within_the_budget():
    s = Scheduler(KVCacheManager(20, BS), max_num_seqs=4, max_num_batched_tokens=6)
    a, b = make("a", 3), make("b", 14, base=50)
    s.add_request(a)
    assert tokens(step(s)) == {"a": 3}
    s.add_request(b)
    assert tokens(step(s)) == {"a": 1, "b": 5}  # running first, the rest of the budget to the newcomer
    assert tokens(step(s)) == {"a": 1, "b": 5}
    assert tokens(step(s)) == {"a": 1, "b": 4}
    assert b.output_token_ids == [7] and a.output_token_ids == [7] * 4


def test_fcfs_and_max_num_seqs():
    s = Scheduler(KVCacheManager(20, BS), max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [make(str(i), 2, base=10 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    assert tokens(step(s)) == {"0": 2, "1": 2}
    assert [r.request_id for r in s.waiting] == ["2"]
    s.finish(reqs[0], "stop")
    assert tokens(step(s)) == {"1": 1, "2": 2}


def test_preempt_newest_by_recompute_then_resume_first():
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 8), make("b", 7, base=50)  # a: blocks 0, 1; b: blocks 2, 3 (one slot left)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2, 3]
    out = step(s)  # a (9 tokens) needs a 3rd block: none free, so b (the newest) is preempted
    assert out.preempted == ["b"] and tokens(out) == {"a": 1}
    assert kv.block_ids("a") == [0, 1, 3] and kv.block_ids("b") == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and s.running == [a]
    assert out.blocks_to_swap_out == []
    s.finish(a, "stop")
    out = step(s)  # b re-prefills its prompt and its first output token
    assert tokens(out) == {"b": 8} and b.status == RequestStatus.RUNNING
    assert b.output_token_ids == [7, 7]


def test_preempt_newest_by_swap_and_swap_back_in():
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100, swap=SwapSpace(4))
    a, b = make("a", 8), make("b", 7, base=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    out = step(s)
    assert out.preempted == ["b"]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)]  # b's two blocks to CPU blocks 0, 1
    assert b.swapped_blocks == [0, 1] and b.num_computed_tokens == 7  # nothing to recompute
    assert s.swap.num_free == 2 and s.num_swap_outs == 1
    s.finish(a, "stop")  # frees 1, 0, 3 (tail first)... a held [0, 1, 3]
    out = step(s)
    assert tokens(out) == {"b": 1}  # only its sampled token: the rest comes back from CPU
    assert kv.block_ids("b") == [2, 3]
    assert out.blocks_to_swap_in == [(0, 2), (1, 3)]
    assert b.swapped_blocks is None and s.swap.num_free == 4


def test_swap_space_full_falls_back_to_recompute():
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100, swap=SwapSpace(1))
    a, b = make("a", 8), make("b", 7, base=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    out = step(s)
    assert out.preempted == ["b"] and out.blocks_to_swap_out == [] and b.num_computed_tokens == 0


def test_no_admission_in_a_step_that_preempted():
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b, c = make("a", 8), make("b", 7, base=50), make("c", 1, base=90)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.add_request(c)
    out = step(s)
    assert out.preempted == ["b"] and tokens(out) == {"a": 1}
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_prefix_hits_are_recorded_on_admission():
    kv = KVCacheManager(10, BS)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    s.add_request(make("a", 9))
    step(s)
    b = make("b", 10)  # shares a's first 2 blocks
    s.add_request(b)
    out = step(s)
    assert tokens(out) == {"a": 1, "b": 2}
    assert [c.start for c in out.chunks] == [9, 8]
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (9 + 10, 8)


def short_pool_with_a_long_second_prompt():
    """4 blocks of 4: a (8 tokens) fits, b (12 tokens) does not fit beside it."""
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 8), make("b", 12, base=50)
    s.add_request(a)
    s.add_request(b)
    return kv, s, a, b


def test_a_prompt_that_does_not_fit_is_admitted_with_the_free_blocks():
    kv, s, a, b = short_pool_with_a_long_second_prompt()
    out = step(s)
    assert tokens(out) == {"a": 8, "b": 8}  # b needs 3 blocks, 2 are free: it starts with 8 tokens
    assert [c.samples for c in out.chunks] == [True, False]
    assert kv.block_ids("b") == [2, 3] and b.num_computed_tokens == 8


def test_a_decode_takes_the_last_block_of_the_newest_prefill_rather_than_preempting_it():
    kv, s, a, b = short_pool_with_a_long_second_prompt()
    step(s)
    out = step(s)  # a's 9th token needs a block: b gives back block 3 and 4 of its tokens, then waits
    assert out.preempted == [] and tokens(out) == {"a": 1}
    assert kv.block_ids("a") == [0, 1, 3] and kv.block_ids("b") == [2]
    assert b.num_computed_tokens == 4 and b.status == RequestStatus.RUNNING and s.running == [a, b]
    s.finish(a, "stop")
    assert tokens(step(s)) == {"b": 8}  # the rest of b's prompt, then its first token
    assert b.output_token_ids == [7]


def test_prefills_that_hold_the_whole_pool_give_way_newest_first():
    kv = KVCacheManager(4, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 12), make("b", 12, base=50)
    for r in (a, b):  # each has computed 8 of 12 prompt tokens in 2 blocks: nothing is free
        s.running.append(r)
        r.status = RequestStatus.RUNNING
        assert kv.allocate_slots(r, 8) is not None
        r.num_computed_tokens = 8
    out = s.schedule()
    assert out.preempted == ["b"] and tokens(out) == {"a": 4}
    assert list(s.waiting) == [b] and b.num_computed_tokens == 0 and kv.block_ids("b") == []


def test_a_paused_prefill_uses_the_blocks_of_a_decode_that_preempted_itself():
    kv = KVCacheManager(3, BS, enable_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 12), make("b", 8, base=50)
    for r, n in ((a, 4), (b, 8)):  # a: 4 of 12 prompt tokens in 1 block; b: decoding, its 2 blocks full
        s.running.append(r)
        r.status = RequestStatus.RUNNING
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens = n
    b.append_token(7, 0.0)
    assert kv.num_free_blocks == 0
    out = s.schedule()  # a waits (nothing free); b needs a block, is the newest and gives way; a takes its 2
    assert out.preempted == ["b"] and tokens(out) == {"a": 8} and s.running == [a]
    assert kv.block_ids("a") == [0, 2, 1]
