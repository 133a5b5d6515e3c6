"""The offload store index: which offloaded blocks exist, their pins, LRU and ARC eviction.

Spec chapter `offload-manager`. An offloaded block spans `block_size_factor` GPU blocks; its key is
the block hash of its last GPU block (OFF-KEY-1).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvconform.reference.errors import InvalidCall

OffloadKey = bytes

STORING = -1
"""OFF-MGR-6: the ref count of a block being stored; such a block is not readable."""


@dataclass
class StoredBlock:
    slot: int
    ref_count: int = STORING

    @property
    def is_ready(self) -> bool:
        return self.ref_count >= 0


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    slots: list[int]
    evicted: list[OffloadKey]
    policy_victims: list[OffloadKey] | None = field(default_factory=list)
    """The blocks the eviction policy picked, None where it found too few; other than `evicted` when the caller's
    victims were taken instead."""


@dataclass
class StoreEvent:
    keys: list[OffloadKey]
    removed: bool


class LRUPolicy:
    """OFF-LRU-1: evict the least recently used block that nobody reads or is storing."""

    def __init__(self, capacity: int) -> None:
        self.blocks: dict[OffloadKey, StoredBlock] = {}
        self.evictable: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> StoredBlock | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: StoredBlock) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]
        self.evictable.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Make `keys` most recent, the first key last (OFF-LRU-2)."""
        for key in reversed(keys):
            if key in self.evictable:
                self.evictable.move_to_end(key)

    def choose(self, count: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """Return `count` victims in LRU order, skipping `protected`; None if short."""
        victims = list(itertools.islice((key for key in self.evictable if key not in protected), count))
        return victims if len(victims) == count else None

    def evict(self, keys: Sequence[OffloadKey]) -> list[tuple[OffloadKey, StoredBlock]]:
        """Remove `keys` and return them with their blocks."""
        victims = [(key, self.blocks[key]) for key in keys]
        for key in keys:
            self.remove(key)
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable[key] = None

    def contents(self) -> list[tuple[OffloadKey, StoredBlock]]:
        return list(self.blocks.items())

    def mark_pinned(self, key: OffloadKey) -> None:
        del self.evictable[key]

    def clear(self) -> None:
        self.blocks.clear()
        self.evictable.clear()


class ARCPolicy:
    """OFF-ARC-1: adaptive replacement between a recency list T1 and a frequency list T2; with `t1_fallback`, a T1
    victim where T1 is under its target and T2 has none (OFF-ARC-4's variant)."""

    def __init__(self, capacity: int, t1_fallback: bool = False) -> None:
        self.capacity = capacity
        self.t1_fallback = t1_fallback
        self.target_t1 = 0.0
        self.t1: OrderedDict[OffloadKey, StoredBlock] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, StoredBlock] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> StoredBlock | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, block: StoredBlock) -> None:
        """New blocks enter T1 and leave the ghost lists (OFF-ARC-2)."""
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Promote ready T1 blocks to T2, refresh T2, adapt the T1 target on ghost hits (OFF-ARC-3)."""
        for key in reversed(keys):
            if key in self.t1:
                block = self.t1.pop(key)
                (self.t2 if block.is_ready else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def choose(self, count: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """Pick victims from T1 while it is at or above target, else from T2, else (with `t1_fallback`) from T1
        (OFF-ARC-4); None if short."""
        chosen: list[OffloadKey] = []
        t1_size = len(self.t1)
        for _ in range(count):
            victim = None
            if t1_size >= int(self.target_t1):
                victim = self._first_idle(self.t1, protected, chosen)
                if victim is not None:
                    t1_size -= 1
            if victim is None:
                victim = self._first_idle(self.t2, protected, chosen)
            if victim is None and self.t1_fallback:
                victim = self._first_idle(self.t1, protected, chosen)
                if victim is not None:
                    t1_size -= 1
            if victim is None:
                return None
            chosen.append(victim)
        return chosen

    def evict(self, keys: Sequence[OffloadKey]) -> list[tuple[OffloadKey, StoredBlock]]:
        """Remove `keys`, remembering each in the ghost list of the list it left, and return them with their blocks."""
        victims = []
        for key in keys:
            from_t1 = key in self.t1
            victims.append((key, self.t1.pop(key) if from_t1 else self.t2.pop(key)))
            (self.b1 if from_t1 else self.b2)[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return victims

    @staticmethod
    def _first_idle(
        blocks: OrderedDict[OffloadKey, StoredBlock], protected: set[OffloadKey], taken: list[OffloadKey]
    ) -> OffloadKey | None:
        for key, block in blocks.items():
            if block.ref_count == 0 and key not in protected and key not in taken:
                return key
        return None

    def mark_evictable(self, key: OffloadKey) -> None:
        return None

    def contents(self) -> list[tuple[OffloadKey, StoredBlock]]:
        return [*self.t1.items(), *self.t2.items()]

    def mark_pinned(self, key: OffloadKey) -> None:
        return None

    def clear(self) -> None:
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target_t1 = 0.0


@dataclass
class OffloadManager:
    """The scheduler-side index of the offload store (OFF-MGR-1 to OFF-MGR-9)."""

    num_slots: int
    policy_name: str = "lru"
    arc_t1_fallback: bool = False
    """The arc policy's variant (OFF-ARC-4): `EngineConfig.arc_t1_fallback`."""
    events: list[StoreEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy: LRUPolicy | ARCPolicy
        if self.policy_name == "lru":
            self.policy = LRUPolicy(self.num_slots)
        elif self.policy_name == "arc":
            self.policy = ARCPolicy(self.num_slots, self.arc_t1_fallback)
        else:
            raise InvalidCall("OFF-MGR-1", f"unknown eviction policy {self.policy_name!r}")
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.num_evictable = 0

    def lookup(self, key: OffloadKey) -> bool | None:
        """Return True if `key` is readable, None while it is being stored, else False (OFF-MGR-2)."""
        block = self.policy.get(key)
        if block is None:
            return False
        return True if block.is_ready else None

    def prepare_load(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Pin readable blocks for a load and return their slots (OFF-MGR-3)."""
        slots = []
        for key in keys:
            block = self.policy.get(key)
            if block is None or not block.is_ready:
                raise InvalidCall("OFF-MGR-3", f"load of a key that is not readable: {key.hex()}")
            if block.ref_count == 0:
                self.policy.mark_pinned(key)
                self.num_evictable -= 1
            block.ref_count += 1
            slots.append(block.slot)
        return slots

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark keys recently used, earlier keys more recent (OFF-MGR-4)."""
        self.policy.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """Unpin the blocks of a finished load (OFF-MGR-3)."""
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.ref_count <= 0:
                raise InvalidCall("OFF-MGR-3", f"complete_load of a key that is not pinned: {key.hex()}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def prepare_store(self, keys: Sequence[OffloadKey],
                      victims: Sequence[OffloadKey] | None = None) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet held, evicting idle unprotected blocks (OFF-MGR-5, OFF-MGR-7).

        `victims`, when they are as many idle unprotected blocks as the store is short of, are evicted instead of the
        policy's, also where the policy finds too few (a known deviation of the engine under test, followed so the
        example goes on)."""
        to_store = [key for key in keys if self.policy.get(key) is None]
        evicted: list[OffloadKey] = []
        policy_victims: list[OffloadKey] | None = []
        shortfall = len(to_store) - len(self.free_slots)
        if to_store and shortfall > 0:
            policy_victims = (self.policy.choose(shortfall, protected=set(keys))
                              if shortfall <= self.num_evictable else None)
            if victims is not None and self._evictable(victims, keys, shortfall):
                evicted = list(victims)
            elif policy_victims is None:
                return None
            else:
                evicted = policy_victims
            freed = self.policy.evict(evicted)
            self.num_evictable -= len(freed)
            self.free_slots.extend(block.slot for _, block in freed)
            self.events.append(StoreEvent(evicted, removed=True))
        slots = [self.free_slots.pop() for _ in to_store]
        for key, slot in zip(to_store, slots, strict=True):
            self.policy.insert(key, StoredBlock(slot))
        return PrepareStoreOutput(to_store, slots, evicted, policy_victims)

    def _evictable(self, victims: Sequence[OffloadKey], keys: Sequence[OffloadKey], count: int) -> bool:
        """Return True if `victims` are `count` distinct held, idle blocks, none of them among `keys`
        (OFF-MGR-3, -7)."""
        blocks = [self.policy.get(key) for key in victims]
        return (len(set(victims)) == count and not set(victims) & set(keys)
                and all(block is not None and block.ref_count == 0 for block in blocks))

    def complete_store(self, keys: Iterable[OffloadKey], success: bool) -> None:
        """Make stored blocks readable, or drop them when the store failed (OFF-MGR-6)."""
        stored = []
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_count = 0
                self.num_evictable += 1
                self.policy.mark_evictable(key)
                stored.append(key)
            else:
                self.policy.remove(key)
                self.free_slots.append(block.slot)
        if stored:
            self.events.append(StoreEvent(stored, removed=False))

    def reset(self) -> None:
        """Forget every block (OFF-MGR-8), the readable ones announced removed (EVT-CLEAR-1)."""
        readable = [key for key, block in self.policy.contents() if block.is_ready]
        if readable:
            self.events.append(StoreEvent(readable, removed=True))
        self.policy.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.num_evictable = 0

    def contents(self) -> list[tuple[OffloadKey, StoredBlock]]:
        """Return every held block with its status, in no particular order."""
        return self.policy.contents()

    def pinned_keys(self) -> set[OffloadKey]:
        """Return the keys of the blocks a load still reads (OFF-MGR-3)."""
        return {key for key, block in self.contents() if block.ref_count > 0}

    def num_pinned(self) -> int:
        """Return how many blocks a load still reads (LIFE-LEAK-1)."""
        return len(self.pinned_keys())

    def take_events(self) -> list[StoreEvent]:
        events, self.events = self.events, []
        return events
