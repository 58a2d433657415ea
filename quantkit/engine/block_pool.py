"""The KV block pool: reference counts, an O(1) LRU free list, and the prefix-cache map.

In the manner of vLLM's v1 `block_pool.py`. Every block is always in exactly one of two states:
  ref_cnt > 0   held by one or more requests, not in the free list;
  ref_cnt == 0  in the free list (LRU order: the head is evicted first). A free block may still
                carry a hash: its contents are a valid cached prefix block until it is reused.
The free list is doubly linked through the blocks themselves, so taking a cached block back out
of it on a prefix hit is O(1) (nano-vllm's `deque.remove` is O(n)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """A full block's hash, chained from its parent's so equal blocks at different depths differ."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept beside the hash: a hit also compares the ids
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None


class FreeBlockQueue:
    """Doubly linked list of free blocks; popleft, append and remove are all O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        out, node = [], self._head.next_free
        while node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """All KV blocks of the cache, with their free list and the prefix-cache map hash -> block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # a miss, or a hash collision caught by the id comparison
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take prefix-hit blocks for one more request, reviving free ones out of the LRU list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """n blocks from the head of the free list, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full block under its hash (the first block with a given hash keeps it)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.cached[block_hash] = block

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the LRU tail in the order given."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.reset_hash()

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
