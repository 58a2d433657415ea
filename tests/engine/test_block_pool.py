"""BlockPool and its free list: exact block ids, reference counts and LRU order."""

from __future__ import annotations

import pytest

from quantkit.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def test_free_queue_append_popleft_remove_are_ordered():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.ids() == [0, 1, 2, 3, 4] and q.num_free == 5
    q.remove(blocks[2])  # O(1) removal from the middle
    assert q.ids() == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert q.ids() == [1, 3, 4, 2] and q.num_free == 4
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the list


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0, 0, 0]
    assert pool.free_queue.ids() == [3, 4, 5]
    assert pool.usage() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_free_appends_in_the_given_order_and_touch_revives():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.touch([a])  # shared by a second request
    pool.free_blocks([c, b, a])  # tail first
    assert [x.ref_cnt for x in (a, b, c)] == [1, 0, 0]
    assert pool.free_queue.ids() == [3, 2, 1]
    pool.touch([b])  # a prefix hit on a free block takes it out of the list
    assert b.ref_cnt == 1 and pool.free_queue.ids() == [3, 2]


def test_cached_block_is_found_until_reused_and_hash_collisions_are_caught():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(a, h, [1, 2, 3, 4])
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is a
    assert pool.get_cached_block(h, [1, 2, 3, 5]) is None  # same hash, other ids: a miss
    pool.free_blocks([a])
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is a  # free but still cached
    pool.get_new_blocks(2)  # block 1, then block 0 (evicted)
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is None and a.block_hash is None


def test_hash_is_chained_from_the_parent():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [1, 2])
    assert hash_block_tokens(7, [1, 2]) == hash_block_tokens(7, (1, 2))


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 123, [1])
    assert pool.cached == {} and a.block_hash is None
