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


def common_prefix_len(rows: torch.Tensor) -> int:
    """The number of leading columns where every row of `rows` (int [R, n]) equals the first."""
    same = (rows == rows[0]).all(0)
    return rows.shape[1] if bool(same.all()) else int(same.int().argmin())


def visible_blocks(seq_len: int, query_len: int, block_size: int) -> int:
    """Leading full blocks whose keys all lie at or before the chunk's first query (at seq_len - query_len)."""
    return (seq_len - query_len + 1) // block_size


def plan_shared_prefix(seq_lens: list[int], query_lens: list[int], table: torch.Tensor,
                       block_size: int) -> SharedPrefix | None:
    """Groups of >= MIN_SEQUENCES sequences starting with the same blocks, or None when there are none.

    `table` is the step's block table (int32 [B, max blocks], quantkit.engine.block_table): the
    comparison is one tensor op a group, whatever the sequences' lengths.
    """
    first = table[:, 0].tolist() if table.shape[1] else [0] * len(seq_lens)
    members: dict[int, list[int]] = {}
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        if seq_len > 0 and query_len > 0:
            members.setdefault(first[i], []).append(i)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    groups, skips = [], [0] * len(seq_lens)
    for rows in members.values():
        if len(rows) < MIN_SEQUENCES:
            continue
        # no deeper than any member's first query sees; within that, every member holds its blocks
        limit = min(visible_blocks(seq_lens[i], query_lens[i], block_size) for i in rows)
        if limit < 1:
            continue
        shared = common_prefix_len(table[rows, :limit])
        if shared < 1:
            continue
        tokens = [t for i in rows for t in range(starts[i], starts[i + 1])]
        groups.append(PrefixGroup(blocks=table[rows[0], :shared].clone(),
                                  tokens=torch.tensor(tokens, dtype=torch.int32)))
        for i in rows:
            skips[i] = shared
    if not groups:
        return None
    return SharedPrefix(groups=groups, skip_blocks=torch.tensor(skips, dtype=torch.int32))
