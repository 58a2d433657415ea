"""Which blocks a step's sequences share, for cascade attention: exact groups, skips and query rows."""

from __future__ import annotations

import torch

from quantkit.engine.attention import block_table, build_metadata, use_cpu_kernel
from quantkit.engine.shared_prefix import common_prefix_len, plan_shared_prefix, visible_blocks


def test_common_prefix_len():
    assert common_prefix_len(torch.tensor([[1, 2, 3, 5], [1, 2, 4, 5], [1, 2, 3, 5]])) == 2
    assert common_prefix_len(torch.tensor([[5], [6]])) == 0
    assert common_prefix_len(torch.tensor([[1, 2], [1, 2]])) == 2


def plan(seq_lens: list[int], query_lens: list[int], block_ids: list[list[int]], block_size: int):
    return plan_shared_prefix(seq_lens, query_lens, block_table(block_ids), block_size)


def test_visible_blocks_stop_where_a_first_query_would_need_a_mask():
    # block_size 4: a decode at position 8 (seq_len 9) sees keys 0..8, so blocks 0 and 1 whole
    assert visible_blocks(9, 1, 4) == 2
    # a decode at position 7 sees all of block 1 (keys 4..7): the prefix may end right at it
    assert visible_blocks(8, 1, 4) == 2
    # a chunk of 6 new tokens at positions 6..11: its first query sees keys 0..6, block 0 only
    assert visible_blocks(12, 6, 4) == 1


def test_decodes_sharing_blocks_form_one_group():
    block_ids = [[7, 8, 3], [7, 8, 4], [7, 8, 9, 5]]
    shared = plan([10, 12, 13], [1, 1, 1], block_ids, 4)
    assert shared.skip_blocks.tolist() == [2, 2, 2]
    assert len(shared.groups) == 1
    assert shared.groups[0].blocks.tolist() == [7, 8]
    assert shared.groups[0].tokens.tolist() == [0, 1, 2]


def test_groups_by_first_block_and_unshared_sequences_skip_nothing():
    block_ids = [[1, 2, 3], [4, 5], [1, 2, 6], [4, 5, 9], [8]]
    shared = plan([12, 7, 12, 9, 3], [1, 1, 1, 1, 1], block_ids, 4)
    assert shared.skip_blocks.tolist() == [2, 1, 2, 1, 0]  # [4, 5]: sequence 1 decodes inside block 5
    assert [g.blocks.tolist() for g in shared.groups] == [[1, 2], [4]]
    assert [g.tokens.tolist() for g in shared.groups] == [[0, 2], [1, 3]]


def test_prefill_chunks_after_a_hit_keep_their_flat_rows():
    # two prompts of 11 tokens share blocks [3, 4] (8 cached tokens); 3 new tokens each
    shared = plan([11, 11], [3, 3], [[3, 4, 5], [3, 4, 6]], 4)
    assert shared.skip_blocks.tolist() == [2, 2]
    assert shared.groups[0].tokens.tolist() == [0, 1, 2, 3, 4, 5]


def test_nothing_shared_gives_none():
    assert plan([5, 6], [1, 1], [[1, 2], [3, 4]], 4) is None
    assert plan([5], [1], [[1, 2]], 4) is None  # one sequence alone
    assert plan([4, 4], [4, 4], [[1], [1]], 4) is None  # a full prefill of the same block


def test_metadata_carries_the_plan_on_the_cpu_kernel_path():
    meta = build_metadata([10, 12], [1, 1], [[7, 8, 3], [7, 8, 4]], 4, torch.device("cpu"), torch.float32)
    if use_cpu_kernel(torch.device("cpu"), torch.float32):
        assert meta.shared_prefix.skip_blocks.tolist() == [2, 2]
    else:
        assert meta.shared_prefix is None
