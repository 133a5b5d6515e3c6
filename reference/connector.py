"""The offload connector: scheduler side and worker side (spec chapters `connector` and `transfer`).

The scheduler side decides what to load and store each step; the worker side moves the bytes.
Offloaded block `i` of a request spans its GPU blocks `i*factor .. i*factor+factor-1` and is keyed
by the block hash of the last of them (OFF-KEY-1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvconform.common.kv_events import MEDIUM_CPU
from kvconform.common.values import EngineConfig
from kvconform.reference.kv_events import Event, block_removed, block_stored
from kvconform.reference.offload_manager import OffloadKey, OffloadManager
from kvconform.reference.recorder import StepRecorder
from kvconform.reference.request import Request, RequestStatus
from kvconform.reference.transfer import TransferEngine


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class TransferJob:
    """One load or store: offloaded blocks of one request and the GPU blocks they map to."""

    job_id: int
    request_id: str
    is_store: bool
    keys: list[OffloadKey]
    offload_indices: list[int]
    gpu_blocks: list[int]
    rows: list[int]
    first_gpu_block: int = 0  # of a load: the request's logical GPU block its first row goes to


@dataclass
class SchedulerOutput:
    """What the scheduler decided in one step, as the connector sees it."""

    num_scheduled_tokens: dict[str, int]
    requests: dict[str, Request]
    block_ids: dict[str, list[int]]
    allocated_block_ids: set[int]
    preempted_request_ids: set[str]
    finished_request_ids: list[str] = field(default_factory=list)
    first_run_block_ids: set[int] = field(default_factory=set)
    """Blocks of requests that run for the first time in the step that are not newly allocated: their local hit,
    or every block of a request that waited for a load."""


@dataclass
class ConnectorMetadata:
    """The per-step instructions for the worker side (CONN-STEP-3)."""

    load_jobs: list[TransferJob]
    store_jobs: list[TransferJob]
    jobs_to_flush: set[int]


@dataclass
class ConnectorOutput:
    """What the worker side reports back: finished jobs and whether each succeeded (CONN-STEP-4)."""

    finished_jobs: dict[int, bool] = field(default_factory=dict)


@dataclass
class ConnectorUpdate:
    """The scheduler-visible effect of a connector output."""

    loads_done: dict[str, bool] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class KnownDeviations:
    """The followed engine's own choices in one step where the run declares that it deviates from the spec (its known
    failures): the connector and the store take them in place of their own, so the example goes on past them
    (CONF-RUN-2). None where the run declares no such deviation."""

    lookups: dict[str, tuple[int, ...]] | None = None
    """Per request asked: the offloaded blocks looked up (OFF-LOOKUP-1); where they stop short of the reference's
    own, the answer is judged from those blocks alone."""
    offers: dict[str, tuple[int, ...]] | None = None
    """Per request: the offloaded blocks offered to the store, none if absent (OFF-STORE-1, OFF-READ-3)."""
    victims: dict[str, tuple[OffloadKey, ...]] | None = None
    """Per offering request: the blocks its prepare_store call evicted (OFF-LRU-1, OFF-ARC-1)."""


NO_DEVIATIONS = KnownDeviations()


@dataclass
class RequestOffloadState:
    request: Request
    num_local_tokens: int = 0
    next_stored_index: int = 0
    transfer_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    block_ids: list[int] = field(default_factory=list)
    """The GPU blocks the connector learned from the steps that scheduled the request since its latest lookup: vLLM's
    connector sees no others, so a request that never ran has none to offer at finish (OFF-STORE-6)."""
    finish_offer_due: bool = False
    load_failed: bool = False


class OffloadConnectorScheduler:
    """Scheduler side of the connector (chapter `connector`)."""

    def __init__(self, manager: OffloadManager, config: EngineConfig, recorder: StepRecorder):
        """`config` gives the block sizes and the behaviour variants the connector follows (its `VARIANTS` fields)."""
        self.manager = manager
        self.config = config
        self.block_size = config.block_size
        self.factor = config.block_size_factor
        self.offloaded_block_size = config.block_size * config.block_size_factor
        self.recorder = recorder
        self.states: dict[str, RequestOffloadState] = {}
        self.jobs: dict[int, TransferJob] = {}
        self.job_counter = 0
        self.stale_job_threshold = 0
        self.keys_being_loaded: set[OffloadKey] = set()
        self.store_jobs_by_gpu_block: dict[int, set[int]] = {}
        self.pending_loads: list[TransferJob] = []
        self.pending_flushes: set[int] = set()
        self.key_origin: dict[OffloadKey, tuple[str, int]] = {}
        self.event_payloads: dict[OffloadKey, Event] = {}
        """Each offload key ever stored -> the BlockStored that announces it, taken while its request is known (vLLM's
        `OffloadingEventsTracker.record_store`); its BlockRemoved names the same hashes."""
        self.store_differs_since: str | None = None
        """Why the followed engine's store may hold or order other blocks than this one since a declined deviation: a
        victim it evicted otherwise is that deviation's consequence (OFF-LRU-1, OFF-ARC-1); None after a reset."""

    # --- helpers -------------------------------------------------------------------------

    def offload_keys(self, request: Request) -> list[OffloadKey]:
        """Return the keys of the request's full offloaded blocks (OFF-KEY-1)."""
        return request.block_hashes[self.factor - 1 :: self.factor]

    def _new_job(self, state: RequestOffloadState, is_store: bool, indices: list[int], keys: list[OffloadKey],
                 gpu_blocks: list[int], rows: list[int]) -> TransferJob:
        job = TransferJob(self.job_counter, state.request.request_id, is_store, keys, indices, gpu_blocks, rows)
        self.job_counter += 1
        self.jobs[job.job_id] = job
        state.transfer_jobs.add(job.job_id)
        return job

    def _touch(self, request: Request, keys: list[OffloadKey]) -> None:
        """Touch a request's blocks in the store, recording them as the step's touches (OFF-LRU-1)."""
        self.manager.touch(keys)
        self.recorder.touches.extend((request.request_id, index) for index in range(len(keys)))

    # --- the six scheduler-side calls ----------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Start tracking a request; every request is tracked, skip flag or not (OFF-READ-3)."""
        self.states[request.request_id] = RequestOffloadState(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   deviations: KnownDeviations = NO_DEVIATIONS) -> tuple[int | None, bool]:
        """Return the loadable tokens past the local hit and if the load is async (CONN-MATCH-1, CONN-MATCH-4,
        OFF-READ-2, LIFE-LOAD-4, OFF-STORE-7)."""
        state = self.states[request.request_id]
        state.block_ids = []
        if self.config.restart_offers_on_lookup:
            state.next_stored_index = 0
        if state.transfer_jobs:
            return None, False
        state.num_local_tokens = num_computed_tokens
        if request.skip_reading_prefix_cache or (state.load_failed and not self.config.lookup_after_failed_load):
            num_hit_tokens: int | None = 0
        else:
            num_hit_tokens = self._lookup(state)
            if deviations.lookups is not None and request.request_id in deviations.lookups:
                num_hit_tokens = self._adopted_lookup(state, num_hit_tokens, deviations.lookups[request.request_id])
        self._touch(request, self.offload_keys(request))
        return num_hit_tokens, bool(num_hit_tokens)

    def _adopted_lookup(self, state: RequestOffloadState, own: int | None, theirs: tuple[int, ...]) -> int | None:
        """Where the followed engine's lookup stopped short of the reference's (a known OFF-LOOKUP-1 deviation), return
        the answer the blocks it looked up give, else `own`."""
        request_id = state.request.request_id
        looked_up = self.recorder.lookups.get(request_id, [])
        if list(theirs) == looked_up or list(theirs) != looked_up[: len(theirs)]:
            return own
        del self.recorder.lookups[request_id]
        answer = self._lookup(state, lookup_end=self.first_lookup(state) + len(theirs))
        self.recorder.adopted.append(("OFF-LOOKUP-1", f"{request_id!r}: looked up offloaded blocks {list(theirs)}, "
                                                      f"not {looked_up}"))
        return answer

    def _lookup(self, state: RequestOffloadState, lookup_end: int | None = None) -> int | None:
        """Return the loadable tokens: the run of readable offloaded blocks after the local hit, looked up no further
        than offloaded block `lookup_end` if given.

        OFF-LOOKUP-1, OFF-LOOKUP-2, OFF-LOOKUP-3, OFF-LOOKUP-4.
        """
        request, block = state.request, self.offloaded_block_size
        keys = self.offload_keys(request)
        max_hit = min(request.num_tokens, (len(keys) if lookup_end is None else lookup_end) * block)
        if max_hit - state.num_local_tokens < block:
            return 0
        start = self.first_lookup(state)
        hits, deferred = 0, False
        for index in range(start, cdiv(max_hit, block)):
            self.recorder.lookups.setdefault(request.request_id, []).append(index)
            found = self.manager.lookup(keys[index])
            if found is False:
                break
            deferred |= found is None
            hits += 1
        if hits == 0:
            return 0
        if deferred:
            return None
        num_hit_tokens = min(max_hit, block * (start + hits)) - state.num_local_tokens
        if num_hit_tokens < block:
            return 0
        if not self.keys_being_loaded.isdisjoint(keys[start : cdiv(state.num_local_tokens + num_hit_tokens, block)]):
            return None
        return num_hit_tokens

    def first_lookup(self, state: RequestOffloadState) -> int:
        """Return the offloaded block the lookup starts at: the one holding the local hit's end (OFF-LOOKUP-1)."""
        return state.num_local_tokens // self.offloaded_block_size

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Create the load job for the external hit into the request's pending GPU blocks (CONN-ALLOC-1,
        XFER-LOAD-2)."""
        if num_external_tokens == 0:
            return
        state = self.states[request.request_id]
        num_cached = state.num_local_tokens + num_external_tokens
        first_gpu = state.num_local_tokens // self.block_size
        num_gpu = cdiv(num_cached, self.block_size)
        indices = list(range(first_gpu // self.factor, cdiv(num_cached, self.offloaded_block_size)))
        keys = [self.offload_keys(request)[index] for index in indices]
        rows = self.load_rows(dict(zip(indices, self.manager.prepare_load(keys), strict=True)), first_gpu, num_gpu)
        job = self._new_job(state, False, indices, keys, list(block_ids[first_gpu:num_gpu]), rows)
        job.first_gpu_block = first_gpu
        state.next_stored_index = cdiv(num_cached, self.offloaded_block_size)  # OFF-STORE-1: the hit is stored
        self.pending_loads.append(job)
        self.keys_being_loaded.update(keys)
        self.recorder.loads.append((request.request_id, indices, first_gpu, num_gpu - first_gpu))

    def load_rows(self, slot_of: dict[int, int], first_gpu: int, num_gpu: int) -> list[int]:
        """Return the store rows that logical GPU blocks `first_gpu .. num_gpu-1` load from (XFER-LOAD-1).

        GPU block `p` is position `p % f` of offloaded block `p // f`, also when the load starts inside it.
        """
        return [slot_of[p // self.factor] * self.factor + p % self.factor for p in range(first_gpu, num_gpu)]

    def build_connector_meta(self, output: SchedulerOutput,
                             deviations: KnownDeviations = NO_DEVIATIONS) -> ConnectorMetadata:
        """Return this step's loads, stores and flushes (CONN-STEP-3, LIFE-FREE-2)."""
        flush = self.pending_flushes
        if output.preempted_request_ids and self.config.flush_all_on_preemption:
            flush |= set(self.jobs)
        for request_id in output.preempted_request_ids:
            state = self.states.get(request_id)
            if state is not None:
                flush |= {job_id for job_id in state.transfer_jobs if self.jobs[job_id].is_store}
        reused = self.reused_blocks(output)
        for block_id in reused & self.store_jobs_by_gpu_block.keys():  # LIFE-FREE-2
            flush |= self.store_jobs_by_gpu_block[block_id]
        meta = ConnectorMetadata(self.pending_loads, self._build_store_jobs(output, reused, flush, deviations), flush)
        self.recorder.flushed_stores.extend((job.request_id, job.offload_indices) for job_id in sorted(flush)
                                            if (job := self.jobs.get(job_id)) is not None and job.is_store)
        self.pending_loads, self.pending_flushes = [], set()
        for request_id in output.finished_request_ids:
            state = self.states.get(request_id)
            if state is not None:
                state.finish_offer_due = False
                if not state.transfer_jobs:
                    del self.states[request_id]
        return meta

    def _store_candidates(self, output: SchedulerOutput) -> Iterator[tuple[RequestOffloadState, int, list[int]]]:
        """Yield each request whose blocks may be offered now, with its offloadable tokens and its GPU blocks: the
        scheduled ones, and with `offer_at_finish` those finished since the last step (OFF-STORE-1, OFF-STORE-6)."""
        for request_id, num_scheduled in output.num_scheduled_tokens.items():
            state = self.states.get(request_id)
            if state is not None:
                state.block_ids = output.block_ids[request_id]
                yield state, self.offloadable_tokens(state.request, num_scheduled), state.block_ids
        for request_id in output.finished_request_ids:
            state = self.states.get(request_id)
            if state is not None and state.finish_offer_due:
                request = state.request
                computed = request.num_computed_tokens
                if request.status is not RequestStatus.ABORTED:  # the last sampled token has no KV yet
                    computed = min(computed, max(len(request.prompt), request.num_tokens - 1))
                yield state, min(computed, request.num_tokens, len(state.block_ids) * self.block_size), state.block_ids

    def reused_blocks(self, output: SchedulerOutput) -> set[int]:
        """Return the GPU blocks the step puts to a new use, whose pending stores it flushes: those allocated, and
        with `flush_on_hit` also those of requests that run for the first time, their hit included (LIFE-FREE-2)."""
        return output.allocated_block_ids | (output.first_run_block_ids if self.config.flush_on_hit else set())

    def _build_store_jobs(self, output: SchedulerOutput, reused: set[int], flush: set[int],
                          deviations: KnownDeviations) -> list[TransferJob]:
        """Offer every newly full, computed offloaded block to the store (OFF-STORE-1, OFF-STORE-3, OFF-STORE-4)."""
        jobs = []
        for state, num_offloadable, block_ids in self._store_candidates(output):
            request = state.request
            request_id = request.request_id
            end = num_offloadable // self.offloaded_block_size
            indices = self._adopted_offer(request, list(range(state.next_stored_index, end)), end, deviations)
            if not indices:
                continue
            all_keys = self.offload_keys(request)
            offered = [all_keys[index] for index in indices]
            self.recorder.store_offers.append((request_id, indices))
            victims = None if deviations.victims is None else deviations.victims.get(request_id)
            prepared = self.manager.prepare_store(offered, victims)
            self.recorder.offer_evictions.append(list(prepared.evicted) if prepared is not None else [])
            if prepared is None:
                continue
            if prepared.policy_victims is None or set(prepared.evicted) != set(prepared.policy_victims):
                self.recorder.adopted.append(("OFF-LRU-1" if self.config.eviction_policy == "lru" else "OFF-ARC-1",
                                              f"{request_id!r}'s store offer evicted {len(prepared.evicted)} other "
                                              f"block(s) than the policy picks"))
            state.next_stored_index = max(state.next_stored_index, indices[-1] + 1)
            self.recorder.evicted.extend(prepared.evicted)
            if not prepared.keys_to_store:
                continue
            self._touch(request, all_keys)
            job = self._store_job(state, block_ids, indices, offered, prepared.keys_to_store, prepared.slots)
            if state.finished:  # its blocks are free already: flush the store before they are overwritten
                for block_id in job.gpu_blocks:
                    self.store_jobs_by_gpu_block.setdefault(block_id, set()).add(job.job_id)
                if not reused.isdisjoint(job.gpu_blocks):
                    flush.add(job.job_id)
            jobs.append(job)
        return jobs

    def _adopted_offer(self, request: Request, own: list[int], end: int, deviations: KnownDeviations) -> list[int]:
        """Return the blocks the followed engine offered where that is a known deviation and they are computed, full
        offloaded blocks of the request (OFF-STORE-1; OFF-READ-3 for a skip-read request offering fewer), else
        `own`."""
        if deviations.offers is None:
            return own
        theirs = list(deviations.offers.get(request.request_id, ()))
        if theirs == own:
            return own
        if any(index >= end for index in theirs):
            self.store_differs_since = "the offer of uncomputed blocks"
            return own
        clause = "OFF-READ-3" if request.skip_reading_prefix_cache and set(own) - set(theirs) else "OFF-STORE-1"
        self.recorder.adopted.append((clause, f"{request.request_id!r} offered blocks {theirs}, not {own}"))
        return theirs

    @staticmethod
    def offloadable_tokens(request: Request, num_scheduled: int) -> int:
        """Return the request's tokens that are computed once this step's are: they may be offloaded (OFF-STORE-1).

        With async scheduling the token still in flight is not counted yet, so decoded blocks lag a step.
        """
        return min(request.num_computed_tokens + num_scheduled, request.num_tokens)

    def _store_job(self, state: RequestOffloadState, block_ids: list[int], indices: list[int],
                   offered: list[OffloadKey], keys_to_store: list[OffloadKey], slots: list[int]) -> TransferJob:
        slot_of = dict(zip(keys_to_store, slots, strict=True))
        stored = [(index, key) for index, key in zip(indices, offered, strict=True) if key in slot_of]
        gpu_blocks, rows = [], []
        for index, key in stored:
            gpu_blocks += block_ids[index * self.factor : (index + 1) * self.factor]
            rows += [slot_of[key] * self.factor + position for position in range(self.factor)]
        job = self._new_job(state, True, [i for i, _ in stored], [k for _, k in stored], gpu_blocks, rows)
        self.recorder.stores.append((state.request.request_id, job.offload_indices))
        for index, key in stored:
            self.key_origin.setdefault(key, (state.request.request_id, index))
            self.event_payloads[key] = block_stored(state.request, index * self.factor, self.factor, MEDIUM_CPU)
        return job

    def take_events(self) -> list[Event]:
        """Return the store's events since the last call as KV events on the CPU medium, in order: a BlockStored per
        offloaded block made readable, a BlockRemoved of the same GPU-block hashes per one evicted (EVT-STORE-1,
        EVT-REMOVE-1, OFF-MGR-9); a key no store job of this connector wrote (a manager driven directly) is not
        announced."""
        events: list[Event] = []
        for event in self.manager.take_events():
            announced = [self.event_payloads[key] for key in event.keys if key in self.event_payloads]
            if event.removed and announced:
                events.append(block_removed([bytes.fromhex(h) for e in announced for h in e["block_hashes"]],
                                            MEDIUM_CPU))
            elif not event.removed:
                events += announced
        return events

    def update_connector_output(self, output: ConnectorOutput) -> ConnectorUpdate:
        """Apply finished jobs: which loads ended, and which finished requests may now be freed (CONN-STEP-4)."""
        update = ConnectorUpdate()
        for job_id, success in output.finished_jobs.items():
            job = self.jobs.pop(job_id)
            if job_id >= self.stale_job_threshold:
                if job.is_store:
                    self.manager.complete_store(job.keys, success)
                    self.recorder.completed_stores.append((job.request_id, job.offload_indices))
                else:
                    self.manager.complete_load(job.keys)
                    self.recorder.completed_loads.append((job.request_id, job.offload_indices, job.first_gpu_block,
                                                          len(job.gpu_blocks)))
                    self.keys_being_loaded.difference_update(job.keys)
                    self.states[job.request_id].load_failed |= not success  # a stale failure is ignored (OFF-MGR-8)
            for block_id in job.gpu_blocks:
                self._forget_store_reader(block_id, job_id)
            if not job.is_store:
                update.loads_done[job.request_id] = success
            state = self.states.get(job.request_id)
            if state is None:  # forgotten at a reset with `reset_forgets_stores`, then finished (CONN-MATCH-4)
                continue
            state.transfer_jobs.discard(job_id)
            if state.finished and not state.transfer_jobs:
                if not state.finish_offer_due:
                    del self.states[job.request_id]
                update.released.add(job.request_id)
        return update

    def _forget_store_reader(self, block_id: int, job_id: int) -> None:
        readers = self.store_jobs_by_gpu_block.get(block_id)
        if readers is not None:
            readers.discard(job_id)
            if not readers:
                del self.store_jobs_by_gpu_block[block_id]

    def request_finished(self, request: Request) -> bool:
        """Return True to delay freeing the request's GPU blocks (CONN-FIN-1, LIFE-FREE-1, LIFE-FREE-2).

        Pending stores are flushed before their GPU blocks are reused; a pending load delays the free. With
        `offer_at_finish` the request stays tracked until the next step offers the blocks it learned (OFF-STORE-6).
        """
        state = self.states.get(request.request_id)
        if state is None:
            return False
        if self.config.offer_at_finish:
            state.finish_offer_due = True
        elif not state.transfer_jobs:
            del self.states[request.request_id]
            return False
        state.finished = True
        self.flush_stores_before_reuse(state)
        return any(not self.jobs[job_id].is_store for job_id in state.transfer_jobs)

    def flush_stores_before_reuse(self, state: RequestOffloadState) -> None:
        """Remember the GPU blocks a finished request's pending stores read, to flush them before reuse
        (LIFE-FREE-2)."""
        for job_id in state.transfer_jobs:
            job = self.jobs[job_id]
            if job.is_store:
                for block_id in job.gpu_blocks:
                    self.store_jobs_by_gpu_block.setdefault(block_id, set()).add(job_id)

    def reset_cache(self) -> None:
        """Empty the store; in-flight jobs are flushed and their completions ignored (OFF-MGR-8); with
        `reset_forgets_stores` an unfinished request no longer waits for its discarded stores (CONN-MATCH-4); a
        discarded load still holds an aborted request's blocks until it ends (LIFE-ABORT-1)."""
        self.pending_flushes |= self.jobs.keys()
        self.manager.reset()
        self.store_differs_since = None
        self.stale_job_threshold = self.job_counter
        self.keys_being_loaded.clear()
        for request_id, state in list(self.states.items()):
            state.next_stored_index = 0
            if state.finished:  # nothing is offered for it any more; kept only while its jobs are reported
                state.finish_offer_due = False
                if not state.transfer_jobs:
                    del self.states[request_id]
            elif self.config.reset_forgets_stores:
                state.transfer_jobs.difference_update([job_id for job_id in state.transfer_jobs
                                                       if self.jobs[job_id].is_store])


class OffloadConnectorWorker:
    """Worker side of the connector: executes jobs with real tensor copies (chapter `transfer`); with `defer_stores`,
    a step's stores are queued and submitted at the start of the next step (CONN-STEP-2's variant)."""

    def __init__(self, transfer: TransferEngine, defer_stores: bool = False) -> None:
        self.transfer = transfer
        self.defer_stores = defer_stores
        self.in_flight: dict[int, TransferJob] = {}
        self.queued: list[TransferJob] = []
        """Stores prepared in the previous step, not submitted yet (`defer_stores`)."""
        self.released: dict[int, bool] = {}
        """Queued stores the harness let finish, with the outcome of the first completion: each runs when submitted."""
        self.finished: dict[int, bool] = {}

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Before the forward: submit the stores queued in the previous step, run the flushed jobs to completion, then
        submit the loads (CONN-STEP-2, LIFE-FREE-2)."""
        for job in self.queued:
            if job.job_id in self.released:
                self._finish(job, self.released.pop(job.job_id))
            else:
                self.in_flight[job.job_id] = job
        self.queued = []
        for job_id in sorted(meta.jobs_to_flush & self.in_flight.keys()):
            self._finish(self.in_flight.pop(job_id), success=True)
        for job in meta.store_jobs:
            if job.job_id in meta.jobs_to_flush:  # a finished request's store, its blocks about to be reused
                self._finish(job, success=True)
        for job in meta.load_jobs:
            self.in_flight[job.job_id] = job

    def wait_for_save(self, meta: ConnectorMetadata) -> None:
        """After the forward: submit this step's stores, or with `defer_stores` queue them for the next step; their
        bytes are read when they run (XFER-STORE-1)."""
        for job in meta.store_jobs:
            if job.job_id not in meta.jobs_to_flush:
                if self.defer_stores:
                    self.queued.append(job)
                else:
                    self.in_flight[job.job_id] = job

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Run every in-flight job now, with the given outcome per direction; a queued store finishes when it is
        submitted, with the outcome of its first completion (CONN-STEP-4)."""
        for job_id in sorted(self.in_flight):
            job = self.in_flight.pop(job_id)
            self._finish(job, success=not (fail_stores if job.is_store else fail_loads))
        for job in self.queued:
            self.released.setdefault(job.job_id, not fail_stores)

    def _finish(self, job: TransferJob, success: bool) -> None:
        if success:
            self.copy(job)
        self.finished[job.job_id] = success

    def copy(self, job: TransferJob) -> None:
        """Move a job's bytes: its GPU blocks into its store rows, or back (XFER-COPY-1)."""
        if job.is_store:
            self.transfer.copy_to_store(job.gpu_blocks, job.rows)
        else:
            self.transfer.copy_to_gpu(job.rows, job.gpu_blocks)

    def store_sources_in_flight(self) -> set[int]:
        """Return the GPU blocks that in-flight or queued stores will still read (XFER-SAFE-1)."""
        return {block for job in (*self.in_flight.values(), *self.queued) if job.is_store for block in job.gpu_blocks}

    def get_finished(self) -> ConnectorOutput:
        """Report the jobs finished since the last call (CONN-STEP-4)."""
        output = ConnectorOutput(self.finished)
        self.finished = {}
        return output
