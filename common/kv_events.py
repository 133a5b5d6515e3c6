"""The KV events an engine publishes for KV-aware routers (spec chapter `kv-events`), as vLLM's
`vllm/distributed/kv_events.py` defines them: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

An adapter reports the events of a step as `StepObservation.kv_events`: plain mappings, each with its `type`, as a
router decodes them. They are parsed here, by the judge, so a malformed event is a verdict of EVT-FORMAT-1 naming the
event and the step, never a rejected observation. Block hashes are hex strings of the engine's block hash
(PFX-HASH-1), so a router recomputes them from the tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MEDIUM_GPU = "GPU"
"""The medium of the engine's own prefix cache (vLLM's `MEDIUM_GPU`)."""
MEDIUM_CPU = "CPU"
"""The medium of the offload connector's store (vLLM's CPU `OffloadingManager.medium`)."""
MEDIA = (MEDIUM_GPU, MEDIUM_CPU)

HASH_HEX_LENGTH = 32
"""Hex digits of one block hash: the 16 bytes of the engine's block hash (PFX-HASH-1)."""

BlockHashHex = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{HASH_HEX_LENGTH}}}$")]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlockStored(_Event):
    """Blocks that became servable on `medium`: consecutive blocks of one sequence, the first chained on
    `parent_block_hash` (None for a sequence's first block), `block_size` tokens each (EVT-CHAIN-1, EVT-HASH-1)."""

    type: Literal["BlockStored"] = "BlockStored"
    block_hashes: tuple[BlockHashHex, ...] = Field(min_length=1)
    parent_block_hash: BlockHashHex | None
    token_ids: tuple[int, ...]
    block_size: int = Field(ge=1)
    lora_name: str | None = None
    medium: Literal["GPU", "CPU"]
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = Field(
        None, description="each block's extra hash keys (LoRA, cache salt), as vLLM publishes them")


class BlockRemoved(_Event):
    """Blocks that stopped being servable on `medium` (EVT-REMOVE-1)."""

    type: Literal["BlockRemoved"] = "BlockRemoved"
    block_hashes: tuple[BlockHashHex, ...] = Field(min_length=1)
    medium: Literal["GPU", "CPU"]


class AllBlocksCleared(_Event):
    """Every block of the engine's prefix cache stopped being servable: the GPU medium is empty (EVT-CLEAR-1)."""

    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


KVEvent = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]
_EVENT: TypeAdapter[BlockStored | BlockRemoved | AllBlocksCleared] = TypeAdapter(KVEvent)


class EventFormatError(ValueError):
    """An event that does not parse as one of the three (EVT-FORMAT-1); the message says what is wrong."""


def parse_event(raw: Any) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """Return the event a published mapping is, or raise EventFormatError saying why it is none (EVT-FORMAT-1)."""
    if not isinstance(raw, dict):
        raise EventFormatError(f"not a mapping with a 'type': {raw!r}")
    if raw.get("type") not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        raise EventFormatError(f"unknown event type {raw.get('type')!r}")
    try:
        event = _EVENT.validate_python(raw)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'event'}: {e['msg']}" for e in error.errors())
        raise EventFormatError(f"{raw['type']} does not parse: {problems}") from None
    if isinstance(event, BlockStored) and len(event.token_ids) != len(event.block_hashes) * event.block_size:
        raise EventFormatError(f"BlockStored of {len(event.block_hashes)} block(s) of {event.block_size} tokens "
                               f"carries {len(event.token_ids)} token ids")
    return event


def hex_hash(block_hash: bytes) -> str:
    """Return a block hash as events carry it."""
    return block_hash.hex()
