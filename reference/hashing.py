"""Chained block hashes and the KV content function (spec chapter `prefix-cache`)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

NONE_HASH: BlockHash = b"\x00" * 16
"""PFX-HASH-1: the parent hash of a request's first block."""


def extra_keys(lora_name: str | None, cache_salt: str | None, block_index: int) -> tuple[str, ...]:
    """Return the extra keys of one block (PFX-HASH-2): LoRA name always, cache salt on block 0 only."""
    keys: tuple[str, ...] = ()
    if lora_name:
        keys += ("lora:" + lora_name,)
    if cache_salt and block_index == 0:
        keys += ("salt:" + cache_salt,)
    return keys


def hash_block(parent: BlockHash, tokens: Sequence[int], keys: tuple[str, ...]) -> BlockHash:
    """Return the hash of a full block chained on its parent's hash (PFX-HASH-1)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    for key in keys:
        digest.update(b"\x00" + key.encode())
    return digest.digest()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Return the hashes of every full block of `tokens`, extending the already `known` ones."""
    hashes = list(known)
    parent = hashes[-1] if hashes else NONE_HASH
    for index in range(len(hashes), len(tokens) // block_size):
        block = tokens[index * block_size : (index + 1) * block_size]
        parent = hash_block(parent, block, extra_keys(lora_name, cache_salt, index))
        hashes.append(parent)
    return hashes
