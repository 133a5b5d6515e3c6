"""Mutants of the events level (chapter `kv-events`): reference parts that publish what real engines and connectors
got wrong about KV events, each killed by its EVT-* clause (the catalogue's rows, `MUTANTS`)."""

from __future__ import annotations

import dataclasses

from kvconform.common.kv_events import MEDIUM_CPU
from kvconform.reference.connector import OffloadConnectorScheduler
from kvconform.reference.kv_cache import BlockPool, KVCacheManager
from kvconform.reference.kv_events import Event, block_stored
from kvconform.reference.offload_manager import OffloadManager
from kvconform.reference.request import Request


def _stored_on_cpu(event: Event) -> bool:
    return event["type"] == "BlockStored" and event["medium"] == MEDIUM_CPU


class SparseStoreEventsConnector(OffloadConnectorScheduler):
    """Announces an offloaded block by its key alone, chained on the key before: a router following the parent chain
    skips the block's other GPU blocks (vLLM #44488)."""

    def take_events(self):
        events = super().take_events()
        return [dict(event, block_hashes=event["block_hashes"][-1:], block_size=self.block_size,
                     token_ids=event["token_ids"][-self.block_size:], extra_keys=None)
                if _stored_on_cpu(event) else event for event in events]


class EvictionNotAnnouncedManager(OffloadManager):
    """Emits no removed event for the blocks a store preparation evicts (LMCache #5076: BlockStored, never
    BlockRemoved)."""

    def prepare_store(self, keys, victims=None):
        output = super().prepare_store(keys, victims)
        if output is not None and output.evicted:
            self.events = [event for event in self.events if not (event.removed and event.keys == output.evicted)]
        return output


class RankEventsDoubledConnector(OffloadConnectorScheduler):
    """Publishes the store's events twice, as the scheduler's and again as the workers' (vLLM #49689: worker events
    counted globally, not per block)."""

    def take_events(self):
        return [event for event in super().take_events() for _ in range(2)]


class RankEventsLostConnector(OffloadConnectorScheduler):
    """Loses the store's BlockStored events, as an aggregation keeping only the events every rank reported loses the
    ones ranks report differently (vLLM #53129: TP-strided GQA events vanished)."""

    def take_events(self):
        return [event for event in super().take_events() if not _stored_on_cpu(event)]


class SaltlessEventsKVCacheManager(KVCacheManager):
    """Announces cached blocks by hashes computed without the request's cache salt: the events' hashes are not the
    ones the engine caches by, and tenants share them."""

    def announce(self, request: Request, indices: list[int]) -> None:
        super().announce(dataclasses.replace(request, cache_salt=None, block_hashes=[]), indices)


class AnnouncedAtPrepareConnector(OffloadConnectorScheduler):
    """Announces a block when its store is prepared, before its bytes are written and readable (Dynamo #12643:
    events published at another time than the block is usable)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.early: list[Event] = []

    def _store_job(self, state, block_ids, indices, offered, keys_to_store, slots):
        job = super()._store_job(state, block_ids, indices, offered, keys_to_store, slots)
        self.early += [block_stored(state.request, index * self.factor, self.factor, MEDIUM_CPU)
                       for index in job.offload_indices]
        return job

    def take_events(self):
        early, self.early = self.early, []
        return early + [event for event in super().take_events() if not _stored_on_cpu(event)]


class SilentEvictionPool(BlockPool):
    """Evicts a cached block without announcing it."""

    def _uncache(self, block_id: int) -> None:
        events = len(self.events)
        super()._uncache(block_id)
        del self.events[events:]


class SilentEvictionKVCacheManager(KVCacheManager):
    """A prefix cache whose evictions are never announced: a router predicts local hits the engine no longer has."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.pool = SilentEvictionPool(num_blocks)


class ResetNotAnnouncedManager(OffloadManager):
    """Empties the store at a connector reset without announcing it, as vLLM's CPU manager does
    (`v1/kv_offload/cpu/manager.py` `reset_cache`)."""

    def reset(self) -> None:
        events = len(self.events)
        super().reset()
        del self.events[events:]
