"""KVCacheManager with exact expectations, in the manner of vLLM's test_prefix_caching.py.

Block size 4, 10 blocks. Token ids are small ints so block contents are easy to read.
"""

from __future__ import annotations

from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.request import Request
from quantkit.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=8), BS)


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return hits.block_ids(), num_hit


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_prefill_allocates_in_order_and_caches_full_blocks_only():
    kv = KVCacheManager(10, BS)
    req = make_request("0", list(range(10)))  # 2 full blocks + 2 tokens
    hits, num_hit = admit(kv, req)
    assert (hits, num_hit) == ([], 0)
    assert kv.block_ids("0") == [0, 1, 2]
    assert ref_counts(kv) == [1, 1, 1] + [0] * 7
    assert kv.pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9]
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]


def test_shared_prefix_hits_and_reference_counts():
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("0", list(range(10))))
    b = make_request("1", list(range(8)) + [50, 51, 52])  # same first two blocks, other tail
    hits, num_hit = admit(kv, b)
    assert (hits, num_hit) == ([0, 1], 8)
    assert kv.block_ids("1") == [0, 1, 3]
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]
    assert kv.prefix_stats.queries == 0  # the scheduler records lookups, not the manager
    c = make_request("2", [0, 1, 2, 3, 9, 9, 9, 9, 9])  # first block only
    assert admit(kv, c) == ([0], 4)
    assert kv.block_ids("2") == [0, 4, 5]
    assert ref_counts(kv)[:6] == [3, 2, 1, 1, 1, 1]


def test_free_is_tail_first_and_eviction_follows_lru_order():
    kv = KVCacheManager(10, BS)
    a = make_request("0", list(range(12)))  # 3 full blocks: 0, 1, 2
    admit(kv, a)
    b = make_request("1", list(range(100, 108)))  # 2 full blocks: 3, 4
    admit(kv, b)
    kv.free(a)
    assert kv.pool.free_queue.ids() == [5, 6, 7, 8, 9, 2, 1, 0]
    kv.free(b)
    assert kv.pool.free_queue.ids() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1, 2, 3, 4]
    c = make_request("2", list(range(200, 228)))  # 7 new blocks: the 5 never-used ones, then 2 and 1
    admit(kv, c)
    assert kv.block_ids("2") == [5, 6, 7, 8, 9, 2, 1]
    # blocks 2 and 1 lost a's hashes and now hold c's; 0, 3, 4 keep theirs
    assert sorted(b.block_id for b in kv.pool.cached.values()) == list(range(10))
    assert kv.pool.blocks[1].token_ids == tuple(range(224, 228))
    # a's first block survived (evicted last, since it was freed last): a re-run hits it
    again = make_request("3", list(range(12)) + [7])
    assert kv.get_computed_blocks(again)[0].block_ids() == [0]


def test_reviving_a_free_cached_block_removes_it_from_the_free_list():
    kv = KVCacheManager(10, BS)
    a = make_request("0", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert kv.pool.free_queue.ids() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("1", list(range(8)) + [1])
    assert admit(kv, b) == ([0, 1], 8)
    assert kv.block_ids("1") == [0, 1, 2]
    assert kv.pool.free_queue.ids() == [3, 4, 5, 6, 7, 8, 9]


def test_last_token_is_never_a_hit():
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("0", list(range(8))))
    same = make_request("1", list(range(8)))  # fully cached: the last block must still be computed
    hits, num_hit = kv.get_computed_blocks(same)
    assert (hits.block_ids(), num_hit) == ([0], 4)


def test_allocation_fails_without_side_effects_when_short():
    kv = KVCacheManager(3, BS)
    admit(kv, make_request("0", list(range(8))))  # blocks 0, 1
    big = make_request("1", list(range(100, 109)))  # needs 3 blocks, 1 free
    assert kv.allocate_slots(big, 9) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("1") == []


def test_free_cached_hits_count_against_the_free_blocks():
    kv = KVCacheManager(3, BS)
    a = make_request("0", list(range(8)))
    admit(kv, a)  # blocks 0, 1 (both cached)
    kv.free(a)
    other = make_request("x", [90, 91, 92])
    admit(kv, other)  # takes block 2: free list now [1, 0], both cached
    b = make_request("1", list(range(8)) + [5, 6])  # hits 0, 1 and needs one more: 3 > 2 free
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits.block_ids(), num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 2, hits) is None
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [0, 0, 1]


def test_decode_grows_one_block_at_a_boundary_and_caches_it():
    kv = KVCacheManager(10, BS)
    req = make_request("0", [1, 2, 3])
    admit(kv, req)
    assert kv.block_ids("0") == [0]
    req.append_token(4, 0.0)  # 4 tokens now; the 4th is not computed yet
    assert kv.allocate_slots(req, 1).block_ids() == []  # fits in block 0
    req.num_computed_tokens = 4
    assert len(kv.pool.cached) == 1  # block 0 became full and was cached
    req.append_token(5, 0.0)
    assert kv.allocate_slots(req, 1).block_ids() == [1]


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(10, BS, enable_caching=False)
    admit(kv, make_request("0", list(range(8))))
    assert admit(kv, make_request("1", list(range(8)) + [3])) == ([], 0)
    assert kv.block_ids("1") == [2, 3, 4]


def test_affordable_hits_keep_one_block_free_for_new_tokens():
    kv = KVCacheManager(6, BS)
    old = make_request("old", list(range(13)))  # 3 full blocks (0, 1, 2) + 1 token (3)
    admit(kv, old)
    kv.free(old)  # all four back in the free list, tail first; 0, 1, 2 stay cached
    other = make_request("other", list(range(100, 108)))
    admit(kv, other)  # takes the two uncached free blocks first: 4, 5
    assert kv.block_ids("other") == [4, 5] and kv.num_free_blocks == 4
    again = make_request("again", list(range(13)))
    hits, num_hit = kv.get_computed_blocks(again)
    assert (hits.block_ids(), num_hit) == ([0, 1, 2], 12)
    # 4 free blocks: all three hits revive with one to spare; a reserve of 1 leaves room for two;
    # a reserve of 3 for none (one block must stay for the new tokens)
    assert kv.affordable_hits(hits).block_ids() == [0, 1, 2]
    assert kv.affordable_hits(hits, reserve_blocks=1).block_ids() == [0, 1]
    assert kv.affordable_hits(hits, reserve_blocks=3).block_ids() == []
    assert kv.num_fitting_tokens(again, hits) == 1 * BS  # block 3 (or any free one) for token 12
    assert kv.num_fitting_tokens(again) == 4 * BS
