"""`vllm-offloading`: vLLM's OffloadingConnector with vLLM's CPU offloading manager (LRU or ARC).

Real vLLM code: everything of `engine.py`, plus the OffloadingConnector (scheduler and worker sides),
`CPUOffloadingSpec` and `CPUOffloadingManager` with its LRU and ARC policies. Not vLLM code: the forward
(`engine.py`) and the transfer execution (`transfers.py`, behind `offloading_spec.py`). Observations are
recorded from the real objects: the manager's `lookup` / `prepare_load` / `prepare_store` calls and
results, and the load and store jobs of the connector metadata. Offload keys are named
`BlockRef(request, index)` by matching them against each request's own block hashes.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvconform.adapters.contract import ImplementationFailure
from kvconform.adapters.vllm.engine import TransferSeam, VllmAdapter, wrap
from kvconform.adapters.vllm.transfers import HeldTransfers
from kvconform.common.values import BlockRef, Capabilities, EngineConfig, LoadJob, StoreJob, StoreSnapshot

Job = TypeVar("Job", LoadJob, StoreJob)
"""A load or a store: the adapter keeps the two kinds of jobs in flight apart."""


class VllmOffloadingAdapter(VllmAdapter):
    """Drives vLLM's scheduler with the OffloadingConnector and the real CPU offloading manager."""

    name = "vllm-offloading"
    connector_name = "OffloadingConnector"

    def __init__(self) -> None:
        super().__init__()
        self.seam = OffloadingSeam(self, self.manager_built)

    def capabilities(self) -> Capabilities:
        return Capabilities(async_scheduling=True, **self.seam.capabilities(),
                            offer_at_finish=(self.offers_at_finish(),), flush_on_hit=(self.flushes_on_hit(),),
                            lookup_after_failed_load=(not self.skips_lookup_after_failed_load(),),
                            local_hit_after_failed_load=(not self.reports_failed_loads_by_request(),),
                            restart_offers_on_lookup=(self.restarts_offers_on_lookup(),),
                            arc_t1_fallback=(arc_falls_back_to_t1(),), defer_stores=(self.defers_stores(),),
                            reset_forgets_stores=(self.reset_forgets_stores(),),
                            reads_stored_kv=True, **self.base_capabilities())

    def connector_behaviours(self) -> tuple[str, ...]:
        """Return the OffloadingConnector's behaviours among the variants its releases differ in (`capabilities`), and
        its ARC policy's fallback to T1 (`arc_falls_back_to_t1`), each where its code shows it."""
        found = {
            "offers-at-finish: OffloadingConnectorScheduler._build_store_jobs walks finished_req_ids (OFF-STORE-6)":
                self.offers_at_finish(),
            "flushes-on-hit: _update_req_states flushes the stores of hit blocks (LIFE-FREE-2)": self.flushes_on_hit(),
            "no-lookup-after-failed-load: RequestOffloadState.load_failed (LIFE-LOAD-4)":
                self.skips_lookup_after_failed_load(),
            "failed-loads-by-request: OffloadingConnectorWorker.take_failed_recving (LIFE-LOAD-3)":
                self.reports_failed_loads_by_request(),
            "restarts-offers-on-lookup: get_num_new_matched_tokens resets next_stored_chunk_idx (OFF-STORE-7)":
                self.restarts_offers_on_lookup(),
            "arc-t1-fallback: ARCCachePolicy.evict takes a T1 victim when T2 has none (OFF-ARC-4)":
                arc_falls_back_to_t1(),
            "defers-stores: OffloadingConnectorWorker.prepare_store_kv queues a step's stores for the next step "
            "(CONN-STEP-2)": self.defers_stores(),
            "reset-forgets-stores: OffloadingConnectorScheduler.reset_cache clears each request's transfer_jobs "
            "(CONN-MATCH-4)": self.reset_forgets_stores(),
        }
        return tuple(name for name, present in found.items() if present)

    def offers_at_finish(self) -> bool:
        """Return whether the connector offers a finished request's remaining blocks at the next step (OFF-STORE-6):
        0.32+ `_build_store_jobs` walks the scheduler output's `finished_req_ids` too."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

        return "finished_req_ids" in inspect.getsource(OffloadingConnectorScheduler._build_store_jobs)

    def flushes_on_hit(self) -> bool:
        """Return whether a pending store is flushed when its blocks become a hit (LIFE-FREE-2): from 0.23 on,
        `_update_req_states` adds the whole block table of every newly scheduled or resumed request (`yield_req_data`),
        hit blocks included, to the step's allocated blocks, whose pending stores `build_connector_meta` flushes;
        0.34's `update_state_after_alloc` adds those of a request admitted with a load as well."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

        source = inspect.getsource(OffloadingConnectorScheduler._update_req_states)
        return "yield_req_data" in source and "_current_batch_allocated_block_ids" in source

    def skips_lookup_after_failed_load(self) -> bool:
        """Return whether a request whose load failed is never looked up again (LIFE-LOAD-4): 0.34's
        `RequestOffloadState.load_failed`, set in `_update_connector_output`, zeroes every later lookup."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState

        return "load_failed" in RequestOffloadState.__dataclass_fields__

    def reports_failed_loads_by_request(self) -> bool:
        """Return whether the connector reports a failed load by request, not by block (LIFE-LOAD-3): 0.34's worker
        side names it in `failed_recving` (`take_failed_recving`), which the scheduler fails closed:
        `_handle_failed_recving` sets the request's computed tokens to 0 and `_update_waiting_for_remote_kv` frees
        its blocks, local hit included, so it is admitted afresh; a failure named by block (`invalid_block_ids`,
        `_update_requests_with_invalid_blocks`) keeps the tokens before the first failed block."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

        return hasattr(OffloadingConnectorWorker, "take_failed_recving")

    def restarts_offers_on_lookup(self) -> bool:
        """Return whether each lookup makes the request offer its blocks from the first again (OFF-STORE-7): 0.34's
        `get_num_new_matched_tokens` sets `next_stored_chunk_idx` to 0."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

        return "next_stored" in inspect.getsource(OffloadingConnectorScheduler.get_num_new_matched_tokens)

    def defers_stores(self) -> bool:
        """Return whether the worker side submits a step's stores at the start of the next step (CONN-STEP-2's
        variant): its `prepare_store_kv` queues them in `_unsubmitted_store_jobs`, which `handle_preemptions` and
        `start_kv_transfers` submit."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

        prepare = getattr(OffloadingConnectorWorker, "prepare_store_kv", None)
        return prepare is not None and "_unsubmitted_store_jobs" in inspect.getsource(prepare)

    def reset_forgets_stores(self) -> bool:
        """Return whether a connector reset makes the requests forget the jobs it discards (CONN-MATCH-4's variant):
        0.28+ `reset_cache` clears each tracked request's `transfer_jobs` (0.28.0 offloading/scheduler.py:1680), 0.33+
        in the `_reset_cache` it calls; 0.24 keeps them, waiting for completions it ignores (OFF-MGR-8,
        `reset_prefix_cache`)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

        scheduler = OffloadingConnectorScheduler
        methods = (scheduler.reset_cache, getattr(scheduler, "_reset_cache", None))
        return any("transfer_jobs.clear()" in inspect.getsource(method) for method in methods if method is not None)

    def start(self, config: EngineConfig) -> None:
        self.manager: Any = None
        self.pins: dict[bytes, int] = {}
        self.origin: dict[bytes, BlockRef] = {}
        self.loads_in_flight: dict[frozenset[bytes], list[LoadJob]] = {}
        self.stores_in_flight: dict[frozenset[bytes], list[StoreJob]] = {}
        """Jobs in flight by their keys (a set: 0.24 completes a job with its keys as a set), oldest first: two
        requests may store the same keys before either finishes, and a load may read keys that another request
        stores again after a connector reset."""
        self.store_jobs_by_id: dict[int, tuple[frozenset[bytes], StoreJob]] = {}
        self.request_keys: dict[str, list[bytes]] = {}
        self.step_record = _StepRecord()
        super().start(config)

    # --- hooks the spec calls ----------------------------------------------------------------------

    def manager_built(self, manager: Any) -> None:
        if manager is self.manager:
            return
        self.manager = manager
        self.unrecorded_lookup = manager.lookup
        wrap(manager, "lookup", self._record_lookup)
        wrap(manager, "prepare_load", self._record_prepare_load)
        wrap(manager, "complete_load", self._record_complete_load)
        wrap(manager, "prepare_store", self._record_prepare_store)
        wrap(manager, "complete_store", self._record_complete_store)
        wrap(manager, "reset_cache", self._forget_jobs_in_flight)

    # --- offload keys ------------------------------------------------------------------------------

    def keys_of(self, request_id: str) -> list[bytes]:
        """Return the offload keys of a request's full offloaded blocks, from its vLLM block hashes (OFF-KEY-1)."""
        from vllm.v1.kv_offload.base import make_offload_key

        keys = self.request_keys.setdefault(request_id, [])
        hashes = self.requests[request_id].block_hashes
        factor = self.config.block_size_factor
        for position in range(len(keys) * factor + factor - 1, len(hashes), factor):
            keys.append(make_offload_key(hashes[position], 0))
        return keys

    def indices(self, request_id: str, keys: Any) -> tuple[int, ...]:
        """Return the offloaded block indices of `keys` in request `request_id`."""
        own = self.keys_of(request_id)
        return tuple(own.index(key) for key in keys)

    def ref(self, key: bytes) -> BlockRef:
        """Return a BlockRef naming `key`: the block of the request that first stored it."""
        return self.origin[key]

    # --- recording ---------------------------------------------------------------------------------

    def _record_lookup(self, result: Any, key: bytes, context: Any) -> None:
        self.step_record.lookups.setdefault(context.req_id, []).extend(self.indices(context.req_id, [key]))

    def _record_prepare_load(self, result: Any, keys: Any, context: Any) -> None:
        self.step_record.load_keys[context.req_id] = list(keys)
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    def _record_complete_load(self, result: Any, keys: Any, context: Any) -> None:
        for key in keys:
            self.pins[key] -= 1
        self.step_record.completed_loads.append(self._completed_job(self.loads_in_flight, "load", keys))

    def _record_complete_store(self, result: Any, keys: Any, *args: Any, **kwargs: Any) -> None:
        """Record a store job's completion, found by its keys: its request is not an argument up to 0.24."""
        self.step_record.completed_stores.append(self._completed_job(self.stores_in_flight, "store", keys))
        self.store_jobs_by_id = {job_id: job for job_id, job in self.store_jobs_by_id.items()
                                 if job[0] != frozenset(keys)}

    def _completed_job(self, in_flight: dict[frozenset[bytes], list[Job]], kind: str, keys: Any) -> Job:
        """Return, and forget, the oldest job `in_flight` with these keys; vLLM completing a job with keys that no
        job in flight has (reported twice, or never created) is a failure of the implementation (CONN-STEP-4)."""
        waiting = in_flight.get(frozenset(keys))
        if not waiting:
            refs = sorted((self.origin[key] for key in keys if key in self.origin), key=repr)
            raise ImplementationFailure("CONN-STEP-4", f"the manager was asked to complete a {kind} of "
                                                       f"{refs or 'unknown keys'} with no such job in flight")
        job = waiting.pop(0)
        if not waiting:
            del in_flight[frozenset(keys)]
        return job

    def _forget_jobs_in_flight(self, result: Any) -> None:
        """A connector reset discards the jobs in flight, pins included: vLLM ignores their completions (OFF-MGR-8)."""
        self.pins.clear()
        self.loads_in_flight.clear()
        self.stores_in_flight.clear()

    def _record_prepare_store(self, result: Any, keys: Any, context: Any) -> None:
        request_id = context.req_id
        evicted = tuple(self.ref(key) for key in result.evicted_keys) if result is not None else ()
        self.step_record.offers.append(StoreJob(request_id=request_id, offload_indices=self.indices(request_id, keys),
                                                evicted=evicted))
        if result is None:
            return
        for key in result.keys_to_store:
            self.origin.setdefault(key, BlockRef(request_id=request_id, index=self.indices(request_id, [key])[0]))
        self.step_record.evicted += evicted
        self.step_record.prepared[id(result.store_spec)] = (request_id, list(result.keys_to_store))

    def observe_metadata(self, meta: Any) -> None:
        """Record the step's load and store jobs from the connector metadata and hand them to the transfers."""
        record = self.step_record
        for job in meta.load_jobs.values():
            _, gpu = job_specs(job)
            keys = record.load_keys[job.req_id]
            load = LoadJob(request_id=job.req_id, offload_indices=self.indices(job.req_id, keys),
                           first_gpu_block=int(gpu.block_indices[0]), num_gpu_blocks=len(gpu.block_ids))
            record.loads.append(load)
            self.loads_in_flight.setdefault(frozenset(keys), []).append(load)
        for job_id, job in meta.store_jobs.items():
            _, cpu = job_specs(job)
            request_id, keys = record.prepared[id(cpu)]
            store = StoreJob(request_id=request_id, offload_indices=self.indices(request_id, keys))
            record.stores.append(store)
            self.stores_in_flight.setdefault(frozenset(keys), []).append(store)
            self.store_jobs_by_id[job_id] = (frozenset(keys), store)
        for job_id in sorted(getattr(meta, "jobs_to_flush", None) or ()):
            if job_id in self.store_jobs_by_id:
                record.flushed_stores.append(self.store_jobs_by_id[job_id][1])
        for jobs, is_store in ((meta.load_jobs, False), (meta.store_jobs, True)):
            for job_id, job in jobs.items():
                gpu = job_specs(job)[0 if is_store else 1]
                self.transfers.issue(job_id, is_store, (int(b) for b in gpu.block_ids))

    def observe_connector(self, observation: dict[str, Any]) -> None:
        record, self.step_record = self.step_record, _StepRecord()
        observation.update(
            lookups={r: tuple(i) for r, i in record.lookups.items()}, loads=tuple(record.loads),
            store_offers=tuple(record.offers), stores=tuple(record.stores), evicted=tuple(record.evicted),
            completed_loads=tuple(record.completed_loads), completed_stores=tuple(record.completed_stores),
            flushed_stores=tuple(record.flushed_stores))

    # --- state -------------------------------------------------------------------------------------

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        """Reset, then check OFF-MGR-8's "late completions are ignored": no request may still wait for a job the
        reset discarded (up to 0.24 such ids stay in its `transfer_jobs`: a request re-admitted later is deferred
        forever, and one that finishes makes `request_finished` raise KeyError; fixed by vLLM PR #48102)."""
        connector = self.scheduler.connector.connector_scheduler
        discarded = set(connector._jobs) if reset_connector else set()
        result = super().reset_prefix_cache(reset_connector)
        waiting = {r: sorted(s.transfer_jobs & discarded) for r, s in connector._req_status.items()
                   if s.transfer_jobs & discarded}
        if waiting:
            raise ImplementationFailure("OFF-MGR-8", f"after the connector reset, requests still wait for the jobs it "
                                                     f"discarded: {waiting} (OffloadingConnectorScheduler.reset_cache "
                                                     f"keeps each request's transfer_jobs)")
        return result

    def store_contents(self) -> StoreSnapshot:
        from vllm.v1.kv_offload.base import ReqContext

        context = ReqContext(req_id="kvconform-store-contents")
        ready: set[BlockRef] = set()
        storing: set[BlockRef] = set()
        for key, ref in self.origin.items():
            found = lookup_state(self.unrecorded_lookup(key, context))
            if found is not None:
                (ready if found else storing).add(ref)
        return StoreSnapshot(ready=frozenset(ready), storing=frozenset(storing))

    def stored_kv(self, block: BlockRef) -> torch.Tensor:
        """Return the bytes at the CPU slot vLLM's manager holds the block's key in: its cache policy's `BlockStatus`
        names the slot (`block_id` up to 0.24, `chunk_id` from 0.32) that the transfers wrote (XFER-DATA-3)."""
        status = self.manager._policy.get(self.keys_of(block.request_id)[block.index])
        if status is None or not status.is_ready:
            raise ValueError(f"vLLM's CPU manager holds no readable block for {block!r}")
        slot = status.block_id if hasattr(status, "block_id") else status.chunk_id
        factor = self.config.block_size_factor
        return self.kv_tensors.read_store(slot * factor, factor)

    def pinned_offload_blocks(self) -> int:
        return sum(1 for count in self.pins.values() if count > 0)

    def jobs_in_flight(self) -> int:
        return len(self.scheduler.connector.connector_scheduler._jobs)


class OffloadingSeam(TransferSeam):
    """The CPU transfer seam of vLLM's OffloadingConnector: vLLM's own `CPUOffloadingSpec` and CPU offloading manager,
    with kvconform's torch copies (`offloading_spec.KVConformCPUOffloadingSpec`) in place of its CUDA copy kernels.

    `vllm-offloading` observes the manager through it; `vllm-connector` gives it to the OffloadingConnector named by
    its factory name, observing nothing: the vendor passes no code. Transfers finish when the harness completes them.
    """

    in_rank_processes = False
    """Its worker copies are the adapter's `HeldTransfers`, finished when the harness completes them: the ranks stay in
    the adapter's process."""

    def __init__(self, adapter: VllmAdapter, on_manager: Callable[[Any], None] | None = None) -> None:
        self.adapter = adapter
        self.on_manager = on_manager

    @property
    def transfers(self) -> HeldTransfers:
        return self.adapter.transfers

    def capabilities(self) -> dict[str, Any]:
        """Return the capability fields the seam decides: vLLM's two policies, chunks of 1 – 3 GPU blocks, and failed
        transfers where the release can report them; the transfers it holds finish when the harness completes them."""
        return dict(eviction_policies=("lru", "arc"), block_size_factors=(1, 2, 3),
                    transfer_failures=reports_failures(), harness_completes_transfers=True)

    def store_slots(self, config: EngineConfig) -> int:
        return config.num_offload_blocks

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """Return the connector's extra config: the kvconform spec, bound to this seam, and a CPU store of exactly
        `config.num_offload_blocks` offloaded blocks on every rank."""
        from kvconform.adapters.vllm import offloading_spec

        session_id = f"kvconform-{next(_SESSION_IDS)}"
        offloading_spec.SESSIONS[session_id] = self
        alignment = offloading_spec.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        # vLLM sizes a chunk as one rank's pages times the world size (v1/kv_offload/cpu/spec.py:110-113)
        chunk = self.adapter.kv.page_bytes * config.block_size_factor * self.adapter.tensor_parallel_size
        aligned_chunk = -(-chunk // alignment) * alignment
        return {
            "spec_name": "KVConformCPUOffloadingSpec",
            "spec_module_path": offloading_spec.__name__,
            "kvconform_session": session_id,
            "cpu_bytes_to_use": aligned_chunk * config.num_offload_blocks,
            "block_size": config.block_size * config.block_size_factor,
            "eviction_policy": config.eviction_policy,
            # OFF-STORE-1 offers every full computed block, decoded ones included; vLLM's default is prompt only.
            "offload_prompt_only": False,
        }

    def spec_built(self, spec: Any) -> None:
        num_blocks = getattr(spec, "num_blocks", None) or spec.num_chunks
        expected = self.adapter.config.num_offload_blocks
        if num_blocks != expected:
            raise RuntimeError(f"vLLM sized the CPU store at {num_blocks} blocks, not {expected}")

    def manager_built(self, manager: Any) -> None:
        if self.on_manager is not None:
            self.on_manager(manager)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        if (fail_loads or fail_stores) and not reports_failures():
            raise ValueError("this vLLM's OffloadingConnector cannot report failed transfers (capabilities say so)")
        self.transfers.complete(fail_loads, fail_stores)


_SESSION_IDS = itertools.count()


def arc_falls_back_to_t1() -> bool:
    """Return whether the release's ARC policy, asked for a victim while T1 is below its target and T2 holds none,
    takes one from T1 (0.30+: `v1/kv_offload/cpu/policies/arc.py:151-156`) rather than refusing the store (0.24:
    `return None`, :149-150): a probe on a policy holding one evictable T1 chunk."""
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

    policy = ARCCachePolicy(cache_capacity=2)
    policy.t1[b"kvconform-probe"] = types.SimpleNamespace(ref_cnt=0)
    policy.target_t1_size = 2.0
    return policy.evict(1, set()) is not None


def reports_failures() -> bool:
    """Return whether the worker side can report a failed transfer: up to 0.24 it asserts every transfer
    succeeded ("we currently do not support job failures", offloading/worker.py get_finished); 0.32+ marks
    failed jobs completed with success=False."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    return "success" in inspect.signature(OffloadingWorkerMetadata.mark_completed).parameters


class _StepRecord:
    """The manager calls and connector jobs of one step."""

    def __init__(self) -> None:
        self.lookups: dict[str, list[int]] = {}
        self.load_keys: dict[str, list[bytes]] = {}
        self.loads: list[LoadJob] = []
        self.offers: list[StoreJob] = []
        self.prepared: dict[int, tuple[str, list[bytes]]] = {}
        self.stores: list[StoreJob] = []
        self.evicted: list[BlockRef] = []
        self.completed_loads: list[LoadJob] = []
        self.completed_stores: list[StoreJob] = []
        self.flushed_stores: list[StoreJob] = []


def job_specs(job: Any) -> tuple[Any, Any]:
    """Return a transfer job's (source, destination) specs: a `transfer_spec` pair up to 0.24, two fields from 0.32."""
    return job.transfer_spec if hasattr(job, "transfer_spec") else (job.src_spec, job.dst_spec)


LOOKUP_STATES = {"HIT": True, "HIT_PENDING": False, "MISS": None}
"""0.32+ `LookupResult` names; up to 0.24 lookup returns True, None (being stored) or False."""


def lookup_state(result: Any) -> bool | None:
    """Return True (readable), False (being stored) or None (absent) for a manager lookup result."""
    if hasattr(result, "name"):
        return LOOKUP_STATES[result.name]
    return {True: True, None: False, False: None}[result]
