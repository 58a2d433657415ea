"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and slot allocation.

The scheduler talks to it only through `KVCacheBlocks` values and request objects; the pool's
internals stay here (as in vLLM's v1 `kv_cache_manager.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.engine.block_pool import BlockPool, KVBlock
from quantkit.engine.block_table import BlockTable
from quantkit.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler: the interface that hides the pool."""

    blocks: list[KVBlock] = field(default_factory=list)

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.tables = BlockTable()  # the same blocks' ids, as lists and as int32 rows
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of full blocks, and its length in tokens.

        At most num_tokens - 1 tokens count as hits: the last token must run through the
        model so there are logits to sample from. A request that wants prompt logprobs (or pools by mean) computes
        its whole prompt (there are no outputs for cached tokens).
        """
        if not self.enable_caching or request.num_computed_tokens > 0 or request.needs_whole_prompt:
            return KVCacheBlocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash, request.block_tokens(i))
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(hits), len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
        """Blocks for `num_new_tokens` more tokens of `request`, or None when the pool is short.

        Token regions of the request after this call:

            | computed (in its blocks) | new computed (prefix hit) | new tokens (this step) |
            |<- num_computed_tokens -->|<-- len(new_computed)*bs ->|<-- num_new_tokens ---->|
            |<------------- blocks the request holds afterwards: cdiv(total, bs) ------------->|

        Prefix-hit blocks that are free (ref 0) count against the free blocks, since taking
        them removes them from the free list. Full blocks are registered in the prefix cache
        now: their contents are written in this step, before any later read.
        """
        new_computed = new_computed or KVCacheBlocks()
        held = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - len(held) - len(new_computed))
        revived = sum(1 for b in new_computed.blocks if b.ref_cnt == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed.blocks)
        held.extend(new_computed.blocks)
        fresh = self.pool.get_new_blocks(num_new_blocks)
        held.extend(fresh)
        self.tables.append(request.request_id, [b.block_id for b in (*new_computed.blocks, *fresh)])
        self._cache_full_blocks(request, held, total)
        return KVCacheBlocks(fresh)

    def num_fitting_tokens(self, request: Request, new_computed: KVCacheBlocks | None = None,
                           reserve_blocks: int = 0) -> int:
        """How many new tokens `allocate_slots` could take for `request` now, leaving `reserve_blocks` free:
        the free slots of its last block plus whole free blocks (revived prefix hits count as taken)."""
        new_computed = new_computed or KVCacheBlocks()
        held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed)
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        revived = sum(1 for b in new_computed.blocks if b.ref_cnt == 0)
        free = self.pool.num_free_blocks - revived - reserve_blocks
        return max(0, held * self.block_size - num_computed + max(0, free) * self.block_size)

    def affordable_hits(self, hits: KVCacheBlocks, reserve_blocks: int = 0) -> KVCacheBlocks:
        """The longest prefix of `hits` that can be revived while one more block stays free for new
        tokens (and `reserve_blocks` beyond it): a preempted request's own cached blocks come back
        at once instead of waiting, free, until its whole prompt fits."""
        room = self.pool.num_free_blocks - reserve_blocks - 1
        kept = []
        for b in hits.blocks:
            cost = 1 if b.ref_cnt == 0 else 0
            if cost > room:
                break
            room -= cost
            kept.append(b)
        return KVCacheBlocks(kept)

    def release_tail_block(self, request: Request) -> None:
        """Give back the last block of a request that is still prefilling: its computed tokens drop
        to the start of that block, and it recomputes them later."""
        held = self.req_blocks[request.request_id]
        block = held.pop()
        self.tables.pop(request.request_id)
        request.num_computed_tokens = len(held) * self.block_size
        self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks.get(request.request_id, 0), len(held))
        self.pool.free_blocks([block])

    def _cache_full_blocks(self, request: Request, held: list[KVBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(held[i], request.block_hashes[i], request.block_tokens(i))
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release a request's blocks tail first, so its last blocks are evicted first."""
        held = self.req_blocks.pop(request.request_id, [])
        self.tables.release(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(held))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids: a live list, read-only, valid until its blocks next change."""
        return self.tables.ids(request_id)

    def block_table(self, request_ids: list[str]) -> torch.Tensor:
        """int32 [len(request_ids), most blocks held], zero-padded: one gather, whatever the lengths."""
        return self.tables.gather(request_ids)
