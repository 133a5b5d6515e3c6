"""Mutant adapters: the reference with one real vLLM bug put back (spec chapter `conformance`).

They are data for the kit's own tests, for `kvconform mutants` and for the benchmarks, deliberately not
registered as adapters. Each class names the vLLM issue or PR whose bug it reintroduces; each catalogue
row names the clause the kit must fail. A mutant is the smallest change of one reference part that puts
the bug back, so the kit's verdict on it says whether the clause really checks anything.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import Capabilities, EngineConfig, SpecLevel
from kvconform.conformance.mutants import disaggregated as pd
from kvconform.conformance.mutants import events as evt
from kvconform.reference.connector import NO_DEVIATIONS, OffloadConnectorScheduler, OffloadConnectorWorker
from kvconform.reference.engine import Engine, OwnPolicy
from kvconform.reference.hashing import block_hashes
from kvconform.reference.kv_cache import BlockPool, KVCacheManager
from kvconform.reference.offload_manager import ARCPolicy, LRUPolicy, OffloadManager
from kvconform.reference.request import RequestStatus

# --- the seed rule: skip the read, still store -------------------------------------------------


class SkipFlagIgnoredConnector(OffloadConnectorScheduler):
    """vLLM #44585 (fixed by PR #44592): skip_reading_prefix_cache ignored; the prefix is looked up and loaded."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens, deviations=NO_DEVIATIONS):
        state = self.states[request.request_id]
        if state.transfer_jobs:
            return None, False
        state.num_local_tokens = num_computed_tokens
        hits = self._lookup(state)
        self.manager.touch(self.offload_keys(request))
        return hits, bool(hits)


class SkipReturnsEarlyConnector(OffloadConnectorScheduler):
    """PR #44592's rejected first draft: return (0, False) before tracking, so nothing is ever stored."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens, deviations=NO_DEVIATIONS):
        if request.skip_reading_prefix_cache:
            self.states.pop(request.request_id, None)
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens, deviations)


# --- connector decisions ---------------------------------------------------------------------


class AsyncFlagOnZeroConnector(OffloadConnectorScheduler):
    """Answers load_async=True together with 0 tokens (base.py: the flag MUST be False when the count is 0)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens, deviations=NO_DEVIATIONS):
        hits, _ = super().get_num_new_matched_tokens(request, num_computed_tokens, deviations)
        return hits, hits is not None


class HitOneBlockShortConnector(OffloadConnectorScheduler):
    """Answers a run of offloaded blocks found in the store one block short (off by one): the last block found is
    recomputed instead of loaded."""

    def _lookup(self, state, lookup_end=None):
        hits = super()._lookup(state, lookup_end)
        return max(hits - self.offloaded_block_size, 0) if hits else hits


class AnswersDuringTransfersConnector(OffloadConnectorScheduler):
    """A request that still has transfer jobs in flight — a preempted request's stores — is looked up and answered
    at once instead of deferred (None) until they end."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens, deviations=NO_DEVIATIONS):
        state = self.states[request.request_id]
        in_flight, state.transfer_jobs = state.transfer_jobs, set()
        try:
            return super().get_num_new_matched_tokens(request, num_computed_tokens, deviations)
        finally:
            state.transfer_jobs |= in_flight


class HitWhileLoadingConnector(OffloadConnectorScheduler):
    """A hit on blocks still being loaded for another request is answered at once instead of deferred (None) until
    that load ends."""

    def _lookup(self, state, lookup_end=None):
        loading, self.keys_being_loaded = self.keys_being_loaded, set()
        try:
            return super()._lookup(state, lookup_end)
        finally:
            self.keys_being_loaded = loading | self.keys_being_loaded


class LookupPastMissConnector(OffloadConnectorScheduler):
    """The lookup does not stop at the first miss: it probes every remaining block."""

    def _lookup(self, state, lookup_end=None):
        hits = super()._lookup(state, lookup_end)
        request = state.request
        looked_up = self.recorder.lookups.get(request.request_id, [])
        for index in range(looked_up[-1] + 1 if looked_up else 0, len(self.offload_keys(request))):
            looked_up.append(index)
            self.manager.lookup(self.offload_keys(request)[index])
        return hits


class LookupFromStartConnector(OffloadConnectorScheduler):
    """The lookup starts at the request's first offloaded block, probing blocks the local prefix cache already hit."""

    def first_lookup(self, state):
        return 0


class LoadsOneBlockShortConnector(OffloadConnectorScheduler):
    """A hit of several offloaded blocks is loaded without its last one (off by one); those tokens keep stale bytes."""

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens > self.offloaded_block_size:
            num_external_tokens -= self.offloaded_block_size
        super().update_state_after_alloc(request, block_ids, num_external_tokens)


class RedundantLoadConnector(OffloadConnectorScheduler):
    """vLLM #29087: a load covers whole offloaded blocks, reloading GPU blocks the local prefix cache already hit."""

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens == 0:
            return
        state = self.states[request.request_id]
        local = state.num_local_tokens
        state.num_local_tokens = local - local % self.offloaded_block_size
        super().update_state_after_alloc(request, block_ids, num_external_tokens + local - state.num_local_tokens)
        state.num_local_tokens = local


class LoadOffsetIgnoredConnector(OffloadConnectorScheduler):
    """vLLM #28951: a load that starts inside an offloaded block counts positions from the load's first block."""

    def load_rows(self, slot_of, first_gpu, num_gpu):
        return [slot_of[p // self.factor] * self.factor + (p - first_gpu) % self.factor
                for p in range(first_gpu, num_gpu)]


class ReorderedLoadConnector(OffloadConnectorScheduler):
    """A load pairs the GPU blocks of a multi-block job with its store rows in reverse order (data integrity)."""

    def load_rows(self, slot_of, first_gpu, num_gpu):
        return super().load_rows(slot_of, first_gpu, num_gpu)[::-1]


class DecodedBlocksNotOffloadedConnector(OffloadConnectorScheduler):
    """vLLM #33881: under async scheduling, blocks filled by decoded tokens are never offered to the store."""

    @staticmethod
    def offloadable_tokens(request, num_scheduled):
        tokens = OffloadConnectorScheduler.offloadable_tokens(request, num_scheduled)
        return min(tokens, len(request.prompt)) if request.num_output_placeholders else tokens


class TenantlessKeyConnector(OffloadConnectorScheduler):
    """vLLM #44701: the offload key hashes the tokens alone; LoRA name and cache salt are left out."""

    def offload_keys(self, request):
        return block_hashes(request.tokens, self.block_size)[self.factor - 1 :: self.factor]


# --- protecting GPU blocks that stores still read ------------------------------------------------


class NoFlushOnPreemptionConnector(OffloadConnectorScheduler):
    """vLLM #29870: a preempted request's in-flight stores are not flushed before its GPU blocks are reused.

    The kit sees the missing flush (LIFE-FREE-2) first in the store: the reference holds the block readable one
    step after the preemption, the mutant still storing (OFF-MGR-1); once the blocks are reused, XFER-SAFE-1.
    """

    def build_connector_meta(self, output, deviations=NO_DEVIATIONS):
        output.preempted_request_ids = set()
        return super().build_connector_meta(output)


class FreesWhileStoringConnector(OffloadConnectorScheduler):
    """vLLM #45823: a finished request's blocks are freed and reused while its stores still read them."""

    def flush_stores_before_reuse(self, state):
        return None


# --- job reports --------------------------------------------------------------------------------


class CompletesStoresTwiceConnector(OffloadConnectorScheduler):
    """Each finished store is completed in the manager once more at the next step, as if a second report of the same
    job were taken for another one (vLLM's scheduler side counts a job's reports, `pending_count`). The store does not
    notice: the blocks are readable already."""

    def __init__(self, manager, config, recorder):
        super().__init__(manager, config, recorder)
        self.completed_last_step = []

    def update_connector_output(self, output):
        again = [job for job in self.completed_last_step if job.job_id >= self.stale_job_threshold]
        self.completed_last_step = [self.jobs[job_id] for job_id in output.finished_jobs if self.jobs[job_id].is_store]
        for job in again:
            self.manager.complete_store(job.keys, True)
            self.recorder.completed_stores.append((job.request_id, job.offload_indices))
        return super().update_connector_output(output)


# --- the store and the worker ------------------------------------------------------------------


class ResetKeepsStoreManager(OffloadManager):
    """A connector reset leaves the store's blocks in place: reset_prefix_cache(reset_connector=True) still hits."""

    def reset(self) -> None:
        return None


class KeptKeysIgnoredLRUPolicy(LRUPolicy):
    """LRU that chooses its victims as if no key were to be kept."""

    def choose(self, count, protected):
        return super().choose(count, set())


class KeptKeysIgnoredARCPolicy(ARCPolicy):
    """ARC that chooses its victims as if no key were to be kept."""

    def choose(self, count, protected):
        return super().choose(count, set())


class EvictsKeptKeysManager(OffloadManager):
    """vLLM #35846: prepare_store evicted keys it had been asked to keep (the protected set is ignored)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        policies: dict[str, type[LRUPolicy | ARCPolicy]] = {"lru": KeptKeysIgnoredLRUPolicy,
                                                             "arc": KeptKeysIgnoredARCPolicy}
        self.policy = policies[self.policy_name](self.num_slots)


class TouchIgnoredLRUPolicy(LRUPolicy):
    """LRU whose touch refreshes nothing: blocks a request hit are evicted as if unused."""

    def touch(self, keys):
        return None


class PinIgnoredLRUPolicy(LRUPolicy):
    """LRU that leaves a block among the evictable ones, where it was, while a load pins it."""

    def mark_pinned(self, key):
        return None

    def mark_evictable(self, key):
        self.evictable.pop(key, None)
        super().mark_evictable(key)


class SwappedListsARCPolicy(ARCPolicy):
    """ARC that takes its victims from the frequency list T2 while T1 is at or above its target (lists swapped)."""

    def choose(self, count, protected):
        self.t1, self.t2 = self.t2, self.t1
        try:
            return super().choose(count, protected)
        finally:
            self.t1, self.t2 = self.t2, self.t1


class TouchIgnoredManager(OffloadManager):
    """The store's LRU refreshes no block on a hit (OFF-LRU-1: a touched block becomes most recent)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy_name == "lru":
            self.policy = TouchIgnoredLRUPolicy(self.num_slots)


class PinIgnoredARCPolicy(ARCPolicy):
    """ARC that takes a block a load pins as a victim like an idle one."""

    @staticmethod
    def _first_idle(blocks, protected, taken):
        return next((key for key, block in blocks.items()
                     if block.is_ready and key not in protected and key not in taken), None)


class EvictsPinnedManager(OffloadManager):
    """The store evicts blocks a load still reads (OFF-MGR-3: a pinned block is never evicted); the load then reads
    a slot that another block may overwrite. vLLM's CPU manager evicts only blocks whose ref_cnt is 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        policies: dict[str, type[LRUPolicy | ARCPolicy]] = {"lru": PinIgnoredLRUPolicy, "arc": PinIgnoredARCPolicy}
        self.policy = policies[self.policy_name](self.num_slots)

    def prepare_load(self, keys):
        evictable = self.num_evictable  # a pinned block stays evictable
        slots = super().prepare_load(keys)
        self.num_evictable = evictable
        return slots

    def complete_load(self, keys):
        evictable = self.num_evictable
        super().complete_load([key for key in keys if (block := self.policy.get(key)) and block.ref_count > 0])
        self.num_evictable = evictable


class SwappedListsManager(OffloadManager):
    """The store's ARC evicts from T2 where it should from T1 and back (OFF-ARC-4)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy_name == "arc":
            self.policy = SwappedListsARCPolicy(self.num_slots)


class StoringCountsAsMissManager(OffloadManager):
    """A block still being stored is looked up as missing, not as "not yet": the request recomputes what it would
    load a moment later (OFF-LOOKUP-3: such a hit must defer)."""

    def lookup(self, key):
        return super().lookup(key) or False


class UnknownKeyRaisesArcPolicy(ARCPolicy):
    """ARC whose touch raises KeyError for a key the store does not hold."""

    def touch(self, keys):
        for key in keys:
            if self.get(key) is None and key not in self.b1 and key not in self.b2:
                raise KeyError(key.hex())
        super().touch(keys)


class UnknownKeyRaisesManager(OffloadManager):
    """vLLM #34576: ARC's touch of a key the store does not hold raises KeyError (OFF-MGR-4: unknown keys are ignored).

    The adapter raises in the middle of a step, which the kit reports as the call's failure (CONF-CALL-1).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy_name == "arc":
            self.policy = UnknownKeyRaisesArcPolicy(self.num_slots)


class StoreBeforeComputeWorker(OffloadConnectorWorker):
    """vLLM #31341: a store copies its GPU blocks before the forward that computes them: stale bytes are offloaded."""

    def start_load_kv(self, meta):
        super().start_load_kv(meta)
        for job in meta.store_jobs:
            super().copy(job)

    def copy(self, job):
        if not job.is_store:
            super().copy(job)


class StoresDeferredUndeclaredWorker(OffloadConnectorWorker):
    """vLLM's OffloadingConnector worker (`prepare_store_kv`): every store is submitted at the start of the next step,
    while the adapter declares no `defer_stores` (CONN-STEP-2's variant): its stores complete a step late."""

    def __init__(self, transfer, defer_stores=False):
        super().__init__(transfer, defer_stores=True)


class ResetForgetsStoresUndeclaredConnector(OffloadConnectorScheduler):
    """vLLM 0.28+'s OffloadingConnectorScheduler.reset_cache: every request forgets the jobs a connector reset discards,
    while the adapter declares no `reset_forgets_stores` (CONN-MATCH-4's variant): a request whose stores were
    in flight is answered at once after the reset; admitted where the reference still defers it, it can show first
    as an admission the reference's free blocks do not hold (SCHED-ADMIT-1)."""

    def reset_cache(self):
        super().reset_cache()
        for state in self.states.values():
            if not state.finished:
                state.transfer_jobs.clear()


class CorruptingStoreWorker(OffloadConnectorWorker):
    """A store changes one KV element of each block it writes (data integrity)."""

    def copy(self, job):
        super().copy(job)
        if job.is_store:
            self.transfer.store[job.rows, 0, 0] += 1


class CorruptsAtRestWorker(OffloadConnectorWorker):
    """A store writes its blocks whole into a staging copy, which every load reads, and with one KV element changed
    into the store itself: the bytes at rest are wrong, yet no load ever brings them back (data at rest)."""

    def __init__(self, transfer, defer_stores=False):
        super().__init__(transfer, defer_stores)
        self.staging = transfer.store.clone()

    def copy(self, job):
        if job.is_store:
            super().copy(job)
            self.staging[job.rows] = self.transfer.store[job.rows]
            self.transfer.store[job.rows, 0, 0] += 1
            return
        store, self.transfer.store = self.transfer.store, self.staging
        try:
            super().copy(job)
        finally:
            self.transfer.store = store


# --- the engine --------------------------------------------------------------------------------


class NullBlockHandedOutPool(BlockPool):
    """The pool hands out block 0, the null block, like any other (block_pool.py takes it off the free queue first)."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_queue = OrderedDict.fromkeys(range(num_blocks))

    def valid_ids(self, blocks):
        return list(blocks)


class NullBlockHandedOutKVCacheManager(KVCacheManager):
    """The GPU block pool hands out the null block (PFX-NULL-1): a request's KV lands where padding goes. With the
    null block counted free, an idle pool has one free block too many, and a prefix-cache reset is refused
    (PFX-RESET-1), as vLLM's `BlockPool.reset_prefix_cache` refuses one unless exactly the null block is used."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.pool = NullBlockHandedOutPool(num_blocks)


class HitsHeldBlocksOnlyKVCacheManager(KVCacheManager):
    """The GPU prefix cache hits only blocks a running request still holds (PFX-HIT-1: free cached blocks hit too):
    the local hit stops at the first cached block that is free, so a finished request's prefix is never hit again,
    though its blocks keep their hashes until they are reused."""

    def get_computed_blocks(self, request):
        blocks, _ = super().get_computed_blocks(request)
        held = list(itertools.takewhile(lambda block_id: self.pool.ref_counts[block_id] > 0, blocks))
        return held, len(held) * self.block_size


class UncappedHitKVCacheManager(KVCacheManager):
    """The local hit may cover every token of the request, not capped at `num_tokens - 1`: a fully cached prompt is
    scheduled no token and its last token is never recomputed (kv_cache_manager.py caps the hit so that the request
    samples)."""

    def get_computed_blocks(self, request):
        if request.skip_reading_prefix_cache:
            return [], 0
        hit = []
        for block_hash in request.block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * self.block_size


class LoadCoversLastTokenEngine(Engine):
    """A full-prompt load is taken as computing every token: the last token is never recomputed."""

    def _finish_load(self, request, success):
        num_computed = request.num_computed_tokens
        super()._finish_load(request, success)
        if success:
            request.num_computed_tokens = num_computed


class TakesUpLoadsEarlyEngine(Engine):
    """A request waiting for its load is taken up as soon as it is considered, before the connector reports the load
    finished: its blocks are cached, and it runs, over KV not loaded yet (what WAITING_FOR_REMOTE_KVS prevents)."""

    def _schedule_waiting(self, step):
        for request in self.waiting:
            if request.status is RequestStatus.WAITING_FOR_LOAD:
                self.loads_done.setdefault(request.request_id, True)
        super()._schedule_waiting(step)


class FinishesEarlyEngine(Engine):
    """A request with two or more outputs to make finishes one output early (off by one)."""

    @staticmethod
    def reached_end(request):
        return len(request.output) >= max(1, request.max_tokens - 1)


class LoadedRequestsNotFirstEngine(Engine):
    """vLLM #45388: loaded requests wait in plain queue order behind requests that cannot fit while they hold blocks."""

    def order_waiting(self):
        return None


class LeaksOnAbortDuringLoadEngine(Engine):
    """vLLM #32255: a request aborted while its load is in flight never has its GPU blocks freed."""

    def _finish(self, request, status):
        super()._finish(request, status)
        if status is RequestStatus.ABORTED:
            self.delayed_free.discard(request.request_id)


class LeaksBlockOnAbortEngine(Engine):
    """An aborted request keeps a reference on its last GPU block, which is never freed (no leaks)."""

    def abort(self, request_id):
        blocks = self.kv.blocks_of(request_id)
        if blocks:
            self.kv.pool.touch(blocks[-1:])
        super().abort(request_id)


class IgnoresTokenBudgetEngine(Engine):
    """The step's token budget is not enforced: every request is scheduled all the tokens it has left at once."""

    def __init__(self, config, device=None):
        super().__init__(config.model_copy(update={"max_num_batched_tokens": 1 << 30}), device)


class PreemptsOldestPolicy(OwnPolicy):
    """A running request short of blocks preempts the oldest running request the step has not scheduled yet, instead
    of the newest."""

    def victim(self, running, request):
        return running[running.index(request) + 1] if request is not running[-1] else request


class PreemptsOldestEngine(Engine):
    """The engine scheduling by `PreemptsOldestPolicy` (its adapter's name, like every mutant's, seeds the draws of a
    derandomised run)."""

    def __init__(self, config, device=None):
        super().__init__(config, device, policy=PreemptsOldestPolicy)


class FirstChunkKVCacheManager(KVCacheManager):
    """A waiting request is admitted when its first chunk fits, not its full sequence (vLLM's
    `scheduler_reserve_full_isl=False`): admission asks for no blocks beyond those allocate_slots takes for the tokens
    scheduled now, and under chunked prefill running requests then preempt each other (SCHED-ADMIT-1)."""

    def holds_sequence(self, request, computed_blocks):
        return True


class NullBlockCountedEngine(Engine):
    """The pool is sized as if the null block were not one of `num_gpu_blocks`: one block more than the engine has."""

    def __init__(self, config, device=None):
        super().__init__(config.model_copy(update={"num_gpu_blocks": config.num_gpu_blocks + 1}), device)


# --- the connector level: black-box faults, seen only through the public connector API ------------------


class NegativeSkipAnswerAdapter(ReferenceAdapter):
    """A connector answers -1 ("not allowed") to a request that must not read cached KV; vLLM 0.32+'s scheduler
    zeroes such requests' answers itself, so the engine runs on (base.py: the count is never negative)."""

    def observe(self, result):
        observation = super().observe(result)
        skipping = {r for r, request in self.engine.requests.items() if request.skip_reading_prefix_cache}
        answers = tuple(a.model_copy(update={"external_tokens": -1})
                        if a.request_id in skipping and a.external_tokens == 0 else a
                        for a in observation.match_answers)
        return observation.model_copy(update={"match_answers": answers})


class ReportsLoadTwiceConnector(OffloadConnectorScheduler):
    """get_finished reports each finished load again at the next step: a receiving id reported twice."""

    def update_connector_output(self, output):
        update = super().update_connector_output(output)
        again, self.reported_loads = getattr(self, "reported_loads", {}), dict(update.loads_done)
        update.loads_done = {**{r: True for r in again}, **update.loads_done}
        return update


class DropsFinishedLoadsConnector(OffloadConnectorScheduler):
    """get_finished never reports a finished load: the request waits for it forever."""

    def update_connector_output(self, output):
        update = super().update_connector_output(output)
        update.loads_done = {}
        return update


class FreesDelayedBlocksEngine(Engine):
    """request_finished's delay_free=True is ignored: the blocks are freed at once, while the connector still
    writes into them (the kind of vLLM #45823)."""

    def _finish(self, request, status):
        super()._finish(request, status)
        if request.request_id in self.delayed_free:
            self.delayed_free.discard(request.request_id)
            self._free(request.request_id)


class FailedLoadKeptEngine(Engine):
    """A failed load's tokens stay counted as computed: kv_load_failure_policy="recompute" ignored."""

    def _process(self, batch):
        loading = {r: q.num_computed_tokens for r, q in self.requests.items()
                   if q.status is RequestStatus.WAITING_FOR_LOAD}
        super()._process(batch)
        for request_id, num_computed in loading.items():
            if self.loads_done.get(request_id) is False:
                self.requests[request_id].num_computed_tokens = num_computed
                self.loads_done[request_id] = True


PART_KEYWORDS = {KVCacheManager: "kv", OffloadManager: "manager", OffloadConnectorScheduler: "connector",
                 OffloadConnectorWorker: "worker"}
"""The keyword of the reference `Engine`'s constructor that takes each replaceable part."""


@dataclass(frozen=True)
class Mutant:
    """One catalogue row: the reference part that puts the bug back, the vLLM reference, the clauses that observe it.

    The first clause is the one the bug violates. The others are where the same bug can show first, as a
    consequence the kit sees earlier: a key collision makes the store skip a write (OFF-STORE-3), hold or
    evict other blocks than the reference's (OFF-MGR-1, OFF-LRU-1, OFF-ARC-1) or answer another tenant's
    lookup (CONN-MATCH-1), or look up past that tenant's first miss (OFF-LOOKUP-2), before that tenant loads the
    block (OFF-KEY-2); a store a connector reset kept (OFF-MGR-8, judged only through what follows) holds blocks
    the reference's no longer does (OFF-MGR-1), answers hits on them (CONN-MATCH-1) or evicts other victims
    (OFF-LRU-1, OFF-ARC-1), and a request loading a prefix the reference computes leaves the next request of the
    step without the local hit it has in the reference (PFX-HIT-1, compared before the answers); a changed order
    of admission shows as requests scheduled in another order (SCHED-ORDER-1), or, when a request left behind
    cannot fit at all, in the schedule (SCHED-STEP-2) before the livelock it can lead to (LIFE-LIVE-1); blocks
    never freed show as a missing release (LIFE-FREE-1) or a refused prefix-cache reset (PFX-RESET-1) before the
    final leak check; stores whose source blocks are not flushed before reuse, or a leaked block that changes which
    free blocks are reused and so which pending stores the reuse flushes, complete at other steps than the
    reference's (OFF-MGR-1) before any write lands on a block a store still reads (XFER-SAFE-1); a kept
    block evicted in a step with several store offers, where an eviction cannot be told apart from one made
    for a later offer, shows as other victims than the policy's (OFF-LRU-1, OFF-ARC-1) or as different
    blocks written (OFF-STORE-3).
    """

    part: type
    vllm_ref: str
    clauses: tuple[str, ...]
    levels: tuple[SpecLevel, ...] = ("connector", "offloading")

    @property
    def adapter(self) -> type[KVConnectorAdapter]:
        """Return a reference adapter whose engine is built with this mutant's part instead of the reference's (or the
        part, if it is an adapter itself: a reference pair's, at the disaggregated level), reporting the spec levels
        of the row."""
        if "disaggregated" in self.levels:
            return pd.pair_adapter(self.part)
        adapter = self.part if issubclass(self.part, ReferenceAdapter) else engine_adapter(self.part)
        return adapter if self.levels == Mutant.levels else black_box(adapter)


def engine_adapter(part: type) -> type[ReferenceAdapter]:
    """Return a reference adapter, named after `part`, whose engines are that Engine subclass or the reference
    `Engine` given that part through its constructor."""
    engine: Callable[[EngineConfig, torch.device | None], Engine]
    if issubclass(part, Engine):
        engine = part
    else:
        keyword = next(keyword for base, keyword in PART_KEYWORDS.items() if issubclass(part, base))
        given: dict[str, Any] = {keyword: part}  # the Engine parameter that takes a part of that base
        engine = functools.partial(Engine, **given)

    def __init__(self: ReferenceAdapter, device: torch.device | None = None) -> None:
        ReferenceAdapter.__init__(self, device, engine=engine)

    return type(f"{part.__name__}Adapter", (ReferenceAdapter,), {"__init__": __init__})


def black_box(adapter: type[ReferenceAdapter]) -> type[ReferenceAdapter]:
    """Return the adapter reporting the connector level only: judged as any KVConnectorBase_V1, on its own schedule."""

    def capabilities(self) -> Capabilities:
        return adapter.capabilities(self).model_copy(update={"levels": ("connector",)})

    return type(f"BlackBox{adapter.__name__}", (adapter,), {"capabilities": capabilities})


def row(part: type, vllm_ref: str, *clauses: str) -> Mutant:
    return Mutant(part, vllm_ref, clauses)


def black_box_row(part: type, vllm_ref: str, *clauses: str) -> Mutant:
    return Mutant(part, vllm_ref, clauses, ("connector",))


def pair_row(part: type, vllm_ref: str, *clauses: str) -> Mutant:
    """A row of the disaggregated level: a reference pair whose producer or consumer connector is `part`."""
    return Mutant(part, vllm_ref, clauses, ("disaggregated",))


MUTANTS = {
    "skip-flag-ignored": row(SkipFlagIgnoredConnector, "#44585 / PR #44592", "OFF-READ-1"),
    "skip-returns-early": row(SkipReturnsEarlyConnector, "PR #44592 (first draft)", "OFF-READ-3"),
    "stores-not-flushed-on-preemption": row(NoFlushOnPreemptionConnector, "#29870",
                                            "LIFE-FREE-2", "OFF-MGR-1", "XFER-SAFE-1"),
    "store-before-compute": row(StoreBeforeComputeWorker, "#31341", "XFER-DATA-3", "XFER-DATA-1"),
    "load-offset-ignored": row(LoadOffsetIgnoredConnector, "#28951", "XFER-DATA-1"),
    "evicts-kept-keys": row(EvictsKeptKeysManager, "#35846", "OFF-MGR-7", "OFF-STORE-3", "OFF-LRU-1", "OFF-ARC-1"),
    "reset-keeps-store": row(ResetKeepsStoreManager, "OffloadingManager.reset contract", "OFF-MGR-8",
                             "OFF-STORE-3", "OFF-MGR-1", "CONN-MATCH-1", "OFF-LRU-1", "OFF-ARC-1", "PFX-HIT-1"),
    "evicts-pinned": row(EvictsPinnedManager, "cpu/manager.py contract", "OFF-MGR-3"),
    "arc-touch-unknown-key": row(UnknownKeyRaisesManager, "#34576", "OFF-MGR-4", "CONF-CALL-1"),
    "decoded-blocks-not-offloaded": row(DecodedBlocksNotOffloadedConnector, "#33881",
                                        "OFF-STORE-1", "OFF-READ-3"),
    "redundant-load": row(RedundantLoadConnector, "#29087", "CONN-LOAD-2"),
    "frees-while-storing": row(FreesWhileStoringConnector, "#45823", "XFER-SAFE-1", "OFF-MGR-1"),
    "leaks-on-abort-during-load": row(LeaksOnAbortDuringLoadEngine, "#32255", "LIFE-LEAK-1", "LIFE-FREE-1"),
    "loaded-requests-not-first": row(LoadedRequestsNotFirstEngine, "#45388",
                                     "SCHED-ORDER-1", "LIFE-LIVE-1", "SCHED-STEP-2", "OFF-MGR-1"),
    "tenantless-offload-key": row(TenantlessKeyConnector, "#44701",
                                  "OFF-KEY-2", "CONN-MATCH-1", "OFF-STORE-3", "OFF-STORE-1", "OFF-MGR-1",
                                  "OFF-LRU-1", "OFF-ARC-1", "OFF-LOOKUP-2"),
    "storing-counts-as-miss": row(StoringCountsAsMissManager, "offloading scheduler contract",
                                  "OFF-LOOKUP-3", "CONN-MATCH-1", "OFF-LOOKUP-1"),
    "lookup-from-start": row(LookupFromStartConnector, "offloading scheduler contract", "OFF-LOOKUP-1"),
    "loads-one-block-short": row(LoadsOneBlockShortConnector, "offloading scheduler contract", "XFER-LOAD-2"),
    "lru-touch-ignored": row(TouchIgnoredManager, "lru.py contract", "OFF-LRU-1"),
    "arc-lists-swapped": row(SwappedListsManager, "arc.py contract", "OFF-ARC-1"),
    "finishes-early": row(FinishesEarlyEngine, "scheduler contract", "LIFE-FIN-1"),
    "async-flag-on-zero": row(AsyncFlagOnZeroConnector, "base.py contract", "CONN-MATCH-2"),
    "hit-one-block-short": row(HitOneBlockShortConnector, "offloading scheduler contract", "CONN-MATCH-1"),
    "load-covers-last-token": row(LoadCoversLastTokenEngine, "scheduler contract", "LIFE-LOAD-2"),
    "takes-up-loads-early": row(TakesUpLoadsEarlyEngine, "scheduler contract", "LIFE-LOAD-1"),
    "local-hit-covers-last-token": row(UncappedHitKVCacheManager, "kv_cache_manager.py contract", "PFX-HIT-3"),
    "hits-held-blocks-only": row(HitsHeldBlocksOnlyKVCacheManager, "block_pool.py contract", "PFX-HIT-1"),
    "null-block-handed-out": row(NullBlockHandedOutKVCacheManager, "block_pool.py contract", "PFX-NULL-1",
                                 "PFX-RESET-1"),
    "answers-during-transfers": row(AnswersDuringTransfersConnector, "offloading scheduler contract", "CONN-MATCH-4"),
    "hit-while-loading": row(HitWhileLoadingConnector, "offloading scheduler contract", "OFF-LOOKUP-4"),
    "lookup-past-miss": row(LookupPastMissConnector, "offloading scheduler contract", "OFF-LOOKUP-2"),
    "stores-deferred-undeclared": row(StoresDeferredUndeclaredWorker, "offloading/worker.py prepare_store_kv",
                                      "OFF-MGR-1"),
    "reset-forgets-stores-undeclared": row(ResetForgetsStoresUndeclaredConnector,
                                           "offloading/scheduler.py reset_cache (0.28+)", "CONN-MATCH-4",
                                           "SCHED-ADMIT-1"),
    "corrupting-store": row(CorruptingStoreWorker, "data integrity", "XFER-DATA-3", "XFER-DATA-1"),
    "corrupts-at-rest": row(CorruptsAtRestWorker, "data at rest", "XFER-DATA-3"),
    "store-reported-twice": row(CompletesStoresTwiceConnector, "offloading scheduler contract", "CONN-STEP-4"),
    "reordered-load": row(ReorderedLoadConnector, "data integrity", "XFER-DATA-1"),
    "ignores-token-budget": row(IgnoresTokenBudgetEngine, "scheduler contract", "SCHED-STEP-2"),
    "preempts-oldest-unscheduled": row(PreemptsOldestEngine, "scheduler contract", "SCHED-PREEMPT-1", "PFX-HIT-1"),
    "admits-first-chunk-only": row(FirstChunkKVCacheManager, "scheduler_reserve_full_isl", "SCHED-ADMIT-1",
                                   "SCHED-ALLOC-1"),
    "null-block-counted": row(NullBlockCountedEngine, "block_pool.py contract", "SCHED-ALLOC-1", "SCHED-ADMIT-1"),
    "leaks-block-on-abort": row(LeaksBlockOnAbortEngine, "no leaks",
                                "LIFE-LEAK-1", "PFX-RESET-1", "SCHED-STEP-2", "OFF-MGR-1"),
    # the connector level, black box: only what crosses the public connector API and the bytes are seen
    "negative-answer": black_box_row(NegativeSkipAnswerAdapter, "base.py contract", "KVC-MATCH-1"),
    "load-reported-twice": black_box_row(ReportsLoadTwiceConnector, "base.py contract", "KVC-ASYNC-1"),
    "load-never-reported": black_box_row(DropsFinishedLoadsConnector, "base.py contract", "KVC-ASYNC-1"),
    "frees-delayed-blocks": black_box_row(FreesDelayedBlocksEngine, "#45823 (black box)", "KVC-FREE-1"),
    "failed-load-kept": black_box_row(FailedLoadKeptEngine, "kv_load_failure_policy", "KVC-FAIL-1"),
    "skip-flag-ignored-black-box": black_box_row(SkipFlagIgnoredConnector, "#44585 / PR #44592", "KVC-SKIP-1"),
    "cross-tenant-hit-black-box": black_box_row(TenantlessKeyConnector, "#44701", "KVC-HIT-1", "KVC-DATA-1"),
    "corrupting-store-black-box": black_box_row(CorruptingStoreWorker, "data integrity", "KVC-DATA-1"),
    "leaks-block-on-abort-black-box": black_box_row(LeaksBlockOnAbortEngine, "no leaks", "KVC-LEAK-1"),
    # the disaggregated level: a producer/consumer pair joined by the requests' params (chapter `disaggregated`)
    "pd-frees-before-read": pair_row(pd.ReleasesBeforeReadProducer, "aws-samples/aws-do-eks#84", "PD-HOLD-1"),
    "pd-lease-never-ends": pair_row(pd.LeaseNeverEndsProducer, "#20139, #41269", "PD-LEASE-1"),
    "pd-wrong-remote-block-ids": pair_row(pd.WrongRemoteBlocksProducer, "#52232", "PD-PARAMS-1"),
    "pd-aborted-prefill-held": pair_row(pd.HoldsAbortedProducer, "#25067", "PD-ABORT-1"),
    "pd-receive-reported-twice": pair_row(pd.ReportsReceiveTwiceConsumer, "#25067", "PD-ONCE-1"),
    "pd-receive-never-reported": pair_row(pd.NeverReportsConsumer, "#35943", "PD-ONCE-1"),
    "pd-notification-lost": pair_row(pd.LosesNotificationConsumer, "#46283, #41269", "PD-NOTIFY-1"),
    "pd-malformed-params-accepted": pair_row(pd.AcceptsMalformedParamsConsumer, "NIXL scheduler contract",
                                             "PD-PARAMS-2"),
    "pd-load-ignores-local-hit": pair_row(pd.IgnoresLocalHitConsumer, "#18632, #50558", "PD-LOAD-1"),
    "pd-failure-reported-as-success": pair_row(pd.FailureReportedAsSuccessConsumer, "#52232", "PD-FAIL-1"),
    "pd-rank-reads-other-heads": pair_row(pd.ReadsOtherRankHeadsConsumer, "#32375, #23917", "PD-TP-1"),
    "pd-reads-wrong-blocks": pair_row(pd.ReadsWrongBlocksConsumer, "#28951 (on the P/D read)", "PD-DATA-1"),
    "pd-aggregates-one-rank": pair_row(pd.OneRankConsumer, "#19330", "PD-TP-1"),
    "pd-failed-read-lost-in-aggregation": pair_row(pd.ForgetsFailureConsumer, "#52232", "PD-TP-1", "PD-FAIL-1"),
    # the events level: what the engine tells KV-aware routers (chapter `kv-events`)
    "events-sparse-store": row(evt.SparseStoreEventsConnector, "#44488", "EVT-CHAIN-1"),
    "events-eviction-not-announced": row(evt.EvictionNotAnnouncedManager, "LMCache #5076", "EVT-REMOVE-1"),
    "events-rank-doubled": row(evt.RankEventsDoubledConnector, "#49689", "EVT-ONCE-1"),
    "events-rank-lost": row(evt.RankEventsLostConnector, "#53129", "EVT-STORE-1"),
    "events-hash-without-salt": row(evt.SaltlessEventsKVCacheManager, "cache_salt in BlockStored.extra_keys",
                                    "EVT-HASH-1", "EVT-ROUTE-1", "EVT-ORDER-1"),
    "events-announced-at-prepare": row(evt.AnnouncedAtPrepareConnector, "Dynamo #12643", "EVT-TIME-1",
                                       "EVT-REMOVE-1"),
    "events-gpu-eviction-silent": row(evt.SilentEvictionKVCacheManager, "block_pool.py BlockRemoved contract",
                                      "EVT-ROUTE-1"),
    "events-store-reset-silent": row(evt.ResetNotAnnouncedManager, "v1/kv_offload/cpu/manager.py reset_cache",
                                     "EVT-CLEAR-1"),
}
"""Mutant name → catalogue row: first the vLLM bug catalogue of the design notes, then contract and integrity faults."""
