"""A request as the reference engine tracks it (spec chapter `lifecycle`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvconform.common import kv_content
from kvconform.reference import hashing


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting_for_load"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One request: its tokens, their block hashes and KV chain states, and its progress."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    block_size: int
    skip_reading_prefix_cache: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_local_hit_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[hashing.BlockHash] = field(default_factory=list)
    states: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._refresh_hashes()

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def append_output(self, token: int) -> None:
        """Append a sampled token and extend the block hashes (PFX-HASH-1)."""
        self.output.append(token)
        self._refresh_hashes()

    def token_states(self, num_tokens: int, tokens: tuple[int, ...] | None = None) -> list[int]:
        """Return the KV chain states of the first `num_tokens` of `tokens` (default: its own) (XFER-DATA-1)."""
        if len(self.states) < num_tokens:
            initial = kv_content.initial_state(self.lora_name, self.cache_salt)
            self.states = kv_content.token_states(initial, (tokens or self.tokens)[:num_tokens], self.states)
        return self.states[:num_tokens]

    def _refresh_hashes(self) -> None:
        self.block_hashes = hashing.block_hashes(
            self.tokens, self.block_size, self.lora_name, self.cache_salt, self.block_hashes
        )
