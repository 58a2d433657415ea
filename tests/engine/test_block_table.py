"""The block table kept as blocks change: exact rows, zero padding, row reuse and growth; and, through
a scheduler run with prefix hits, tail releases and preemptions, always equal to one built from lists."""

from __future__ import annotations

import random

import torch

from quantkit.engine.attention import block_table
from quantkit.engine.block_table import BlockTable
from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.request import Request
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.scheduler import Scheduler


def test_rows_are_gathered_in_the_asked_order_and_zero_padded():
    t = BlockTable(rows=2, cols=2)
    t.append("a", [4, 5])
    t.append("b", [9])
    t.append("a", [6])  # past the capacity of 2 columns: grows
    assert t.gather(["b", "a"]).tolist() == [[9, 0, 0], [4, 5, 6]]
    assert t.gather(["b"]).tolist() == [[9]]
    assert t.ids("a") == [4, 5, 6] and t.ids("missing") == []


def test_pop_release_and_row_reuse_leave_no_stale_ids():
    t = BlockTable(rows=1, cols=4)
    t.append("a", [1, 2, 3])
    t.append("b", [7])  # a second row: the table doubles its rows
    assert t.pop("a") == 3
    assert t.gather(["a", "b"]).tolist() == [[1, 2], [7, 0]]
    t.release("a")
    t.append("c", [8])  # takes a's old row
    assert t.gather(["c", "b"]).tolist() == [[8], [7]]
    t.append("c", [9, 10])
    assert t.gather(["c"]).tolist() == [[8, 9, 10]]
    assert t.table.shape == (2, 4) and t.ids("a") == []


def test_a_scheduler_run_keeps_the_table_equal_to_the_lists():
    bs, rng = 4, random.Random(0)
    kv = KVCacheManager(12, bs)
    s = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24)
    prefix = list(range(100, 108))  # two shared blocks: prefix hits
    for i in range(12):
        own = [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        s.add_request(Request(str(i), (prefix if i % 2 else []) + own,
                              SamplingParams(max_tokens=rng.randrange(2, 20), ignore_eos=True), bs))
    steps = checked = 0
    while s.has_unfinished() and steps < 400:
        out = s.schedule()
        if out.chunks:
            assert torch.equal(out.block_table, block_table([c.block_ids for c in out.chunks]))
            checked += 1
        s.update_from_output(out)
        for c in out.chunks:
            if c.samples:
                c.request.append_token(7, 0.0)
                if len(c.request.output_token_ids) >= c.request.params.max_tokens:
                    s.finish(c.request, "length")
        steps += 1
    assert not s.has_unfinished() and checked > 20
    assert s.num_preemptions > 0  # the pool of 12 blocks is too small for six at once: the run covers preemption
