"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, one block table per request, and
prefix caching by chained block hashes (PagedAttention, Kwon et al. 2023; vLLM v1's block pool).

Pure CPU bookkeeping, no tensors: the runner owns the K/V tensors and reads the block ids given
here. A block holds `block_size` tokens of every layer's K and V. A full block whose tokens are all
computed gets a hash chained from its parent's, so two requests sharing a prefix share its blocks.
Blocks whose reference count drops to zero go to the tail of a free queue but keep their hash:
they are reused by a later prefix hit, or evicted least-recently-used first when a new block is needed.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head size x bytes (seed: 80 KB/token for the toy, 20 KB with GQA)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many blocks a memory budget holds; at least one, or a clear error."""
    per_block = block_size * bytes_per_token
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes is smaller than one block "
            f"({block_size} tokens x {bytes_per_token} bytes/token = {per_block} bytes)"
        )
    return int(n)


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of a full block: depends on every token before it, so equal hashes mean equal
    prefixes. Stable across processes (blake2b, not Python's salted hash), so a router can compute it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        salt: bytes | None = None) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, in order. `salt` keys them by more than the tokens
    (a LoRA adapter: the same prompt has other K/V under it), mixed into the first block's hash and so,
    chained, into every later one's (vLLM's extra keys)."""
    out: list[bytes] = []
    parent = salt
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    for i in range(n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All blocks, a hash -> block map of cached full blocks, and an LRU queue of free blocks.

    The free queue's head is evicted first. A freed block goes to its tail, so cached blocks that
    were used recently survive longest."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference to cached blocks (a prefix hit): out of the free queue if they were there."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.pop(b.block_id, None)
            b.ref_cnt += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each; `blocks` in eviction order (first = evicted first)."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {b.block_id} freed more often than allocated")
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same content computed twice concurrently: keep the first
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (after a weight update the cached K/V are stale)."""
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # block ids of `blocks`, kept alongside: read every step
    hashes: list[bytes] = field(default_factory=list)  # hashes of its leading full blocks


class KVCacheManager:
    """Block tables per request on top of a BlockPool: prefix lookup, slot allocation, freeing."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req: dict[str, _RequestBlocks] = {}
        self.stats = PrefixCacheStats()

    # -- queries ---------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: callers must not modify it)."""
        r = self.req.get(request_id)
        return r.ids if r else []

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks referenced by some request (cached-but-free blocks do not count)."""
        return sum(1 for b in self.pool.blocks if b.ref_cnt > 0)

    # -- prefix caching --------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            salt: bytes | None = None) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of `token_ids` (hashed with `salt`, as
        prefix_block_hashes). At least one token is left to compute, because the last prompt token's
        logits are needed to sample."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[Block] = []
        parent = salt
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            b = self.pool.lookup(parent)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admitted request (a lookup retried next step is not a new query)."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request_id: str,
        num_tokens_needed: int,
        computed_blocks: Sequence[Block] = (),
    ) -> bool:
        """Make the request's table cover `num_tokens_needed` tokens (cached blocks first).
        Returns False, changing nothing, when the pool cannot supply the blocks."""
        r = self.req.get(request_id)
        have = len(r.blocks) if r else 0
        new_req = r is None
        if new_req:
            have = len(computed_blocks)
        need = -(-num_tokens_needed // self.block_size) - have
        # cached blocks sitting in the free queue are about to be taken out of it
        reclaim = sum(1 for b in computed_blocks if b.ref_cnt == 0) if new_req else 0
        if need > self.pool.num_free - reclaim:
            return False
        if new_req:
            r = self.req[request_id] = _RequestBlocks()
            self.pool.touch(computed_blocks)
            r.blocks.extend(computed_blocks)
            r.ids.extend(b.block_id for b in computed_blocks)
            r.hashes.extend(b.block_hash for b in computed_blocks)  # type: ignore[misc]
        if need > 0:
            new = self.pool.get_new_blocks(need)
            r.blocks.extend(new)
            r.ids.extend(b.block_id for b in new)
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          salt: bytes | None = None) -> None:
        """Register the hashes of the request's full blocks whose K/V are all computed (`salt`: as
        get_computed_blocks)."""
        if not self.enable_prefix_caching:
            return
        r = self.req.get(request_id)
        if r is None:
            return
        n_full = min(num_computed // self.block_size, len(r.blocks))
        parent = r.hashes[-1] if r.hashes else salt
        for i in range(len(r.hashes), n_full):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            r.hashes.append(parent)
            self.pool.cache_block(r.blocks[i], parent)

    def free(self, request_id: str) -> None:
        r = self.req.pop(request_id, None)
        if r is None:
            return
        # tail blocks first into the free queue: they are the least likely to be shared, so evict them first
        self.pool.free(list(reversed(r.blocks)))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        for r in self.req.values():
            r.hashes.clear()
