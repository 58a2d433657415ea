"""Finding the cache blocks that several sequences of one step share (prefix cache hits), for cascade
attention (quantkit.kernels.paged_attention_cpu.SharedPrefix).

Sequences are grouped by their first block id; a group's shared prefix is the longest run of leading
block ids common to all its members, cut so every member's first query of the step sees all of it
(a block is skipped by the per-sequence pass, so no causal mask may fall inside it).
"""

from __future__ import annotations

import torch

from quantkit.kernels.paged_attention_cpu import PrefixGroup, SharedPrefix

MIN_SEQUENCES = 2  # a prefix read by one sequence gains nothing from the extra pass


def common_prefix_len(lists: list[list[int]]) -> int:
    """The number of leading items every list has in common."""
    n = min(len(x) for x in lists)
    first = lists[0]
    for i in range(n):
        if any(x[i] != first[i] for x in lists):
            return i
    return n


def visible_blocks(seq_len: int, query_len: int, block_size: int) -> int:
    """Leading full blocks whose keys all lie at or before the chunk's first query (at seq_len - query_len)."""
    return (seq_len - query_len + 1) // block_size


def plan_shared_prefix(seq_lens: list[int], query_lens: list[int], block_ids: list[list[int]],
                       block_size: int) -> SharedPrefix | None:
    """Groups of >= MIN_SEQUENCES sequences starting with the same blocks, or None when there are none."""
    members: dict[int, list[int]] = {}
    for i, blocks in enumerate(block_ids):
        if blocks and query_lens[i] > 0:
            members.setdefault(blocks[0], []).append(i)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    groups, skips = [], [0] * len(seq_lens)
    for rows in members.values():
        if len(rows) < MIN_SEQUENCES:
            continue
        shared = min(common_prefix_len([block_ids[i] for i in rows]),
                     *(visible_blocks(seq_lens[i], query_lens[i], block_size) for i in rows))
        if shared < 1:
            continue
        tokens = [t for i in rows for t in range(starts[i], starts[i + 1])]
        groups.append(PrefixGroup(blocks=torch.tensor(block_ids[rows[0]][:shared], dtype=torch.int32),
                                  tokens=torch.tensor(tokens, dtype=torch.int32)))
        for i in rows:
            skips[i] = shared
    if not groups:
        return None
    return SharedPrefix(groups=groups, skip_blocks=torch.tensor(skips, dtype=torch.int32))
