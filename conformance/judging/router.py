"""The router model (chapter `kv-events`): a KV-aware router's index of one engine, built only from the events the
engine published, as NVIDIA Dynamo's KV router or llm-d's kv-cache indexer builds it.

Per medium it counts the announcements of each block hash: a BlockStored adds one per hash, a BlockRemoved takes one
away, an AllBlocksCleared empties the GPU medium. A hash is held while its count is positive (vLLM's offloading
events ask consumers to count repeated announcements). The router predicts a request's hit on a medium as the longest
run of its block hashes held there (EVT-ROUTE-1).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvconform.common.kv_events import MEDIA, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


class RouterError(ValueError):
    """An event a router cannot apply: `clause` is the one it breaks."""

    def __init__(self, clause: str, message: str) -> None:
        super().__init__(message)
        self.clause = clause


@dataclass
class Router:
    """One engine's blocks per medium, as its event stream announces them."""

    counts: dict[str, Counter[str]] = field(default_factory=lambda: {medium: Counter() for medium in MEDIA})

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        """Replay one event; a removal of a hash not held on its medium is refused (EVT-ORDER-1)."""
        if isinstance(event, AllBlocksCleared):
            self.counts[MEDIUM_GPU].clear()
        elif isinstance(event, BlockStored):
            self.counts[event.medium].update(event.block_hashes)
        else:
            held = self.counts[event.medium]
            missing = [h for h, n in Counter(event.block_hashes).items() if held[h] < n]
            if missing:
                raise RouterError("EVT-ORDER-1", f"BlockRemoved on {event.medium} of hash(es) {missing} not announced "
                                                 "there")
            held.subtract(event.block_hashes)
            for block_hash in set(event.block_hashes):
                if not held[block_hash]:
                    del held[block_hash]

    def holds(self, medium: str, block_hash: str) -> bool:
        return self.counts[medium][block_hash] > 0

    def run_held(self, medium: str, hashes: list[str], start: int = 0) -> int:
        """Return how many of `hashes` from `start` on are held on `medium`, up to the first that is not."""
        count = 0
        while start + count < len(hashes) and self.holds(medium, hashes[start + count]):
            count += 1
        return count

    def copy(self) -> Router:
        return Router({medium: Counter(counts) for medium, counts in self.counts.items()})
