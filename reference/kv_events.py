"""What the reference engine publishes for KV-aware routers (spec chapter `kv-events`): the block pool's events on the
GPU medium and the offload connector's on the CPU medium, as vLLM's `BlockPool` and `OffloadingEventsTracker` do.

An event is built here as a `kvconform.common.kv_events` model and published as its mapping
(`StepObservation.kv_events`), the form any adapter reports.
"""

from __future__ import annotations

from typing import Any

from kvconform.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, hex_hash
from kvconform.reference.hashing import extra_keys
from kvconform.reference.request import Request

Event = dict[str, Any]


def block_stored(request: Request, first: int, count: int, medium: str) -> Event:
    """Return the BlockStored of a request's GPU-sized blocks `first .. first+count`: their hashes, chained on the
    block before (EVT-CHAIN-1), their tokens, LoRA and extra keys (EVT-HASH-1)."""
    size = request.block_size
    return BlockStored(
        block_hashes=tuple(hex_hash(h) for h in request.block_hashes[first : first + count]),
        parent_block_hash=hex_hash(request.block_hashes[first - 1]) if first else None,
        token_ids=request.tokens[first * size : (first + count) * size], block_size=size,
        lora_name=request.lora_name, medium=medium,
        extra_keys=tuple(extra_keys(request.lora_name, request.cache_salt, index) or None
                         for index in range(first, first + count))).model_dump()


def block_removed(hashes: list[bytes], medium: str) -> Event:
    """Return the BlockRemoved of blocks no longer servable on `medium` (EVT-REMOVE-1)."""
    return BlockRemoved(block_hashes=tuple(map(hex_hash, hashes)), medium=medium).model_dump()


def all_blocks_cleared() -> Event:
    """Return the AllBlocksCleared of a prefix-cache reset (EVT-CLEAR-1)."""
    return AllBlocksCleared().model_dump()
