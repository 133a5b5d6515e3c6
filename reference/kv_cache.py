"""GPU block pool and local prefix cache (spec chapter `prefix-cache`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvconform.common.kv_events import MEDIUM_GPU
from kvconform.reference.errors import InvalidCall
from kvconform.reference.hashing import BlockHash
from kvconform.reference.kv_events import Event, all_blocks_cleared, block_removed, block_stored
from kvconform.reference.request import Request

NULL_BLOCK_ID = 0
"""PFX-NULL-1: block 0 is the null block; it is never handed to a request."""


class BlockPool:
    """GPU blocks with reference counts, an LRU free queue and a hash → block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise InvalidCall("PFX-NULL-1", f"num_gpu_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: dict[int, BlockHash] = {}
        """Block → the hash it was cached under; only cached blocks are keys, so a reset is O(cached)."""
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[BlockHash, dict[int, None]] = {}
        self.events: list[Event] = []
        """The KV events not yet published: each block cached, evicted or cleared (chapter `kv-events`)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        """Return `count` blocks from the free queue's front, evicting their cached hashes (PFX-EVICT-1)."""
        if not 0 <= count <= self.num_free_blocks:
            raise InvalidCall("SCHED-ALLOC-1", f"allocate({count}) with {self.num_free_blocks} free blocks")
        blocks = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on cached blocks, removing free ones from the queue (PFX-HIT-1)."""
        for block_id in self.valid_ids(blocks):
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block; a cached block at zero joins the queue's tail, an uncached one its
        front, in the given order (PFX-EVICT-1)."""
        blocks = self.valid_ids(blocks)
        for block_id in blocks:
            if self.ref_counts[block_id] < blocks.count(block_id):
                raise InvalidCall("PFX-REF-1", f"block {block_id} freed more often than it is referenced")
        uncached = []
        for block_id in blocks:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if block_id not in self.block_hash:
                    uncached.append(block_id)
        for block_id in reversed(uncached):
            self.free_queue.move_to_end(block_id, last=False)

    def valid_ids(self, blocks: Iterable[int]) -> list[int]:
        """Return `blocks` as a list if every id names a real block, never the null block (PFX-NULL-1)."""
        blocks = list(blocks)
        for block_id in blocks:
            if not 0 < block_id < self.num_blocks:
                raise InvalidCall("PFX-NULL-1", f"block id {block_id} is not one of blocks 1..{self.num_blocks - 1}")
        return blocks

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash, after any block already holding it (PFX-HIT-2)."""
        if block_id not in self.block_hash:
            self.block_hash[block_id] = block_hash
            self.cached.setdefault(block_hash, {})[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Return the earliest cached block still holding `block_hash`, if any (PFX-HIT-2)."""
        return next(iter(self.cached.get(block_hash, ())), None)

    def reset(self) -> bool:
        """Forget every cached hash; refused unless every block is free (PFX-RESET-1)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.block_hash.clear()
        self.cached.clear()
        self.events.append(all_blocks_cleared())  # EVT-CLEAR-1
        return True

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hash.pop(block_id, None)
        if block_hash is not None:
            holders = self.cached[block_hash]
            del holders[block_id]
            if not holders:
                del self.cached[block_hash]
            self.events.append(block_removed([block_hash], MEDIUM_GPU))  # EVT-REMOVE-1

    def take_events(self) -> list[Event]:
        """Return the events since the last call, in order (EVT-ORDER-1)."""
        events, self.events = self.events, []
        return events


class KVCacheManager:
    """Allocates GPU blocks to requests and finds their local prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Return the locally cached prefix blocks of a new request and their token count (PFX-HIT-1, PFX-HIT-3)."""
        if request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int],
        num_external_tokens: int,
        delay_caching: bool,
        reserved: int = 0,
    ) -> list[int] | None:
        """Give a request blocks for its new tokens; None when the pool, less `reserved` blocks, is short
        (SCHED-ALLOC-1)."""
        if num_new_tokens < 0 or num_external_tokens < 0:
            raise InvalidCall("SCHED-ALLOC-1", f"negative token counts {num_new_tokens}, {num_external_tokens}")
        computed_blocks = self.pool.valid_ids(computed_blocks)
        num_local = len(computed_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + num_local + num_external_tokens + num_new_tokens
        if self.blocks_to_allocate(request, total_tokens, computed_blocks) > self.pool.num_free_blocks - reserved:
            return None
        owned = self.req_blocks.setdefault(request.request_id, [])
        needed = -(-total_tokens // self.block_size) - len(owned) - len(computed_blocks)
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(max(needed, 0))
        owned.extend(computed_blocks)
        owned.extend(new_blocks)
        if not delay_caching:
            self.cache_blocks(request, min(total_tokens, request.num_tokens))
        return new_blocks

    def holds_sequence(self, request: Request, computed_blocks: list[int]) -> bool:
        """Return True if the free blocks hold the request's full sequence, less its hit: it may be admitted
        (SCHED-ADMIT-1)."""
        return self.blocks_to_allocate(request, request.num_tokens, computed_blocks) <= self.pool.num_free_blocks

    def blocks_to_allocate(self, request: Request, num_tokens: int, computed_blocks: list[int]) -> int:
        """Return the free blocks a request takes to hold `num_tokens` tokens: the new blocks it lacks plus the
        free blocks among its hit, which leave the free queue (SCHED-ALLOC-1)."""
        owned = len(self.req_blocks.get(request.request_id, []))
        missing = max(-(-num_tokens // self.block_size) - owned - len(computed_blocks), 0)
        return missing + sum(1 for block_id in computed_blocks if self.pool.ref_counts[block_id] == 0)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens (PFX-HIT-2)."""
        owned = self.req_blocks.get(request.request_id, [])
        new: list[int] = []
        for index in range(min(num_tokens // self.block_size, len(request.block_hashes), len(owned))):
            if owned[index] not in self.pool.block_hash:
                new.append(index)
            self.pool.cache(owned[index], request.block_hashes[index])
        self.announce(request, new)

    def announce(self, request: Request, indices: list[int]) -> None:
        """Publish the blocks just cached, one BlockStored per run of consecutive blocks (EVT-STORE-1)."""
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            self.pool.events.append(block_stored(request, run[0], len(run), MEDIUM_GPU))

    def free(self, request_id: str) -> list[int]:
        """Release a request's blocks, tail first so they are evicted first (PFX-EVICT-1)."""
        owned = self.pop_blocks(request_id)
        self.pool.free(reversed(owned))
        return owned

    def pop_blocks(self, request_id: str) -> list[int]:
        """Take a request's blocks from it without releasing them; the caller frees them later, tail first."""
        return self.req_blocks.pop(request_id, [])
