"""`vllm-simple-cpu`: vLLM's SimpleCPUOffloadConnector, eager mode.

Real vLLM code: everything of `engine.py`, plus the connector and its scheduler side
(`SimpleCPUOffloadScheduler`: a second, CPU `BlockPool` and `KVCacheCoordinator` keyed by the same block
hashes, so the CPU store is an LRU free queue of GPU-block-sized blocks). Not vLLM code: the forward
(`engine.py`) and the worker handler. vLLM's `SimpleCPUOffloadWorker` copies with CUDA streams, events and
a DMA kernel; this adapter replaces it (`HeldSimpleWorker`) by one that keeps the same metadata protocol —
load and store events in, `finished_recving` and completed store events out — and executes the copies
with the adapter's own torch copies (`transfers.KVTensors`) when the harness completes transfers.

Observations: lookups are the CPU pool's `get_cached_block` calls while the connector answers
`get_num_new_matched_tokens`; loads are the connector's load transfers (`_reqs_to_load`); the blocks the
eager store walks past in a step are its offers, those it allocates CPU blocks for are its stores;
evictions are the CPU pool's evicted cached blocks; a load completes when its request leaves `_reqs_to_load`
and a store when its event leaves `_store_event_to_blocks` as the connector processes the worker's output.
"""

from __future__ import annotations

from typing import Any

import torch

from kvconform.adapters.vllm.engine import TransferSeam, VllmAdapter, wrap
from kvconform.adapters.vllm.transfers import Copy, HeldTransfers
from kvconform.common.values import BlockRef, Capabilities, EngineConfig, LoadJob, StoreJob, StoreSnapshot

LOAD, STORE = 0, 1
"""A simple-connector event `e` is transfer job `2e` (load) or `2e + 1` (store)."""


class HeldSimpleWorker:
    """The worker side of the SimpleCPUOffloadConnector, with transfers held until the harness completes them.

    Up to 0.24 the connector hands the worker its events in `get_finished`; from 0.32 loads in `start_load_kv`
    and stores in `wait_for_save`. Either way each event is submitted once.
    """

    def __init__(self, transfers: HeldTransfers, num_cpu_blocks: int) -> None:
        self.transfers = transfers
        self.num_cpu_blocks = num_cpu_blocks
        self.meta: Any = None
        self.load_requests: dict[int, list[str]] = {}
        self.unreported_store_events: dict[int, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The KV tensors are the adapter's `KVTensors` already."""

    def bind_connector_metadata(self, meta: Any) -> None:
        self.meta, self.pending = meta, {LOAD: meta.load_event >= 0, STORE: meta.store_event >= 0}

    def clear_connector_metadata(self) -> None:
        self.meta = None

    def handle_preemptions(self, meta: Any) -> None:
        """A preemption flushes every pending transfer, as vLLM's worker does (`_flush_and_sync_all`)."""
        if meta.need_flush:
            self.transfers.wait(set(self.transfers.held))

    def start_load_kv(self) -> None:
        meta = self.meta
        if self.pending.pop(LOAD, False):
            self.load_requests[meta.load_event] = list(meta.load_event_to_reqs.get(meta.load_event, ()))
            self.transfers.submit(2 * meta.load_event + LOAD,
                                  Copy(False, tuple(meta.load_gpu_blocks), tuple(meta.load_cpu_blocks)))

    def wait_for_save(self) -> None:
        meta = self.meta
        if self.pending.pop(STORE, False):
            self.transfers.submit(2 * meta.store_event + STORE,
                                  Copy(True, tuple(meta.store_gpu_blocks), tuple(meta.store_cpu_blocks)))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        """Submit this step's events not submitted yet, then report the finished ones."""
        if self.meta is not None:
            self.start_load_kv()
            self.wait_for_save()
        recving: set[str] = set()
        for job_id, _ in self.transfers.take_finished():
            event, kind = divmod(job_id, 2)
            if kind == STORE:
                self.unreported_store_events[event] = 1
            else:
                recving.update(self.load_requests.pop(event))
        return None, recving or None

    def build_connector_worker_meta(self) -> Any:
        """Report the store events completed since the last call, each once (as vLLM's worker does)."""
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        if not self.unreported_store_events:
            return None
        completed, self.unreported_store_events = self.unreported_store_events, {}
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=completed)


class SimpleCPUSeam(TransferSeam):
    """The CPU transfer seam of vLLM's SimpleCPUOffloadConnector: its real scheduler side, with `HeldSimpleWorker` in
    place of its CUDA worker handler. `vllm-simple-cpu` observes the connector around it; `vllm-connector` gives it to
    the SimpleCPUOffloadConnector named by its factory name, observing nothing. Transfers finish when the harness
    completes them."""

    in_rank_processes = False
    """Its worker copies are the adapter's `HeldTransfers`, finished when the harness completes them: the ranks stay in
    the adapter's process."""

    def __init__(self, adapter: VllmAdapter) -> None:
        self.adapter = adapter

    def capabilities(self) -> dict[str, Any]:
        """Return the capability fields the seam decides: one CPU block per GPU block (no block_size_factor), one LRU
        free queue (no policy choice), and no way to report a failed transfer (the worker metadata only carries
        completed store events); the transfers it holds finish when the harness completes them."""
        return dict(eviction_policies=("lru",), block_size_factors=(1,), transfer_failures=False,
                    harness_completes_transfers=True)

    def store_slots(self, config: EngineConfig) -> int:
        return config.num_offload_blocks + 1  # the CPU BlockPool keeps block 0 as its null block

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """Return a CPU store of `store_slots` blocks on every rank: vLLM divides `cpu_bytes_to_use` among the ranks
        (simple_cpu_offload_connector.py:111-114)."""
        page = self.adapter.kv.page_bytes * self.adapter.tensor_parallel_size
        return {"cpu_bytes_to_use": page * self.store_slots(config), "lazy_offload": False}

    def worker_built(self, worker: Any) -> None:
        worker.worker_handler = HeldSimpleWorker(self.adapter.transfers, self.store_slots(self.adapter.config))

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        if fail_loads or fail_stores:
            raise ValueError("the SimpleCPUOffloadConnector cannot report failed transfers (capabilities say so)")
        self.adapter.transfers.complete()


class VllmSimpleCPUAdapter(VllmAdapter):
    """Drives vLLM's scheduler with the SimpleCPUOffloadConnector (eager stores)."""

    name = "vllm-simple-cpu"
    connector_name = "SimpleCPUOffloadConnector"

    def __init__(self) -> None:
        super().__init__()
        self.seam = SimpleCPUSeam(self)

    def capabilities(self) -> Capabilities:
        # Connector reset: 0.23's reset_cache raises NotImplementedError; 0.24 adds SimpleCPUOffloadScheduler.reset.
        # Offers at finish (OFF-STORE-6): 0.34 queues a finished request's confirmed blocks not stored yet
        # (_queue_finished_eager_store) and stores them with the next step's store event.
        # Flush at a preemption (LIFE-FREE-2): every release's scheduler sets need_flush for a step that preempts, and
        # the worker then waits for every load and store in flight (handle_preemptions, _flush_and_sync_all).
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

        shared = {**self.base_capabilities(), "reset_connector": hasattr(SimpleCPUOffloadScheduler, "reset")}
        return Capabilities(async_scheduling=True, reads_stored_kv=True, **self.seam.capabilities(),
                            offer_at_finish=(hasattr(SimpleCPUOffloadScheduler, "_queue_finished_eager_store"),),
                            flush_all_on_preemption=(True,), **shared)

    def connector_behaviours(self) -> tuple[str, ...]:
        """Return whether the connector offers a finished request's last blocks at the next step (OFF-STORE-6), as its
        code shows it (SimpleCPUOffloadScheduler._queue_finished_eager_store)."""
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

        return (("offers-at-finish: SimpleCPUOffloadScheduler._queue_finished_eager_store (OFF-STORE-6)",)
                if hasattr(SimpleCPUOffloadScheduler, "_queue_finished_eager_store") else ())

    def attach(self) -> None:
        self.manager = self.scheduler.connector.scheduler_manager
        self.cpu_pool = self.manager.cpu_block_pool
        self.record: dict[str, Any] = self.empty_record()
        self.looking_up: str | None = None
        self.origin: dict[bytes, BlockRef] = {}
        self.storing: dict[int, list[BlockRef]] = {}
        self.block_owner: dict[int, BlockRef] = {}
        """GPU block → the request block it held when a store last read it."""
        self.finished_blocks: dict[str, list[int]] = {}
        """A finished request's GPU blocks at its finish: 0.32+ stores its last blocks at the next step, when the
        manager no longer tracks the request, or tracks it with blocks that are free by then."""
        self.finish_offers: list[StoreJob] = []
        """Blocks queued at a request's finish, offered (and stored) with the next step's store event."""
        self.loads_in_flight: dict[str, LoadJob] = {}
        self.store_jobs: dict[int, list[StoreJob]] = {}
        """The store jobs of each store event, one per request whose blocks it writes."""
        self.finish_evictions: list[BlockRef] = []
        """Blocks the CPU pool evicted to make room for those queued at a finish, reported with their offers."""
        original = self.manager.get_num_new_matched_tokens

        def answering(request: Any, num_computed_tokens: int) -> Any:
            self.looking_up = request.request_id
            try:
                return original(request, num_computed_tokens)
            finally:
                self.looking_up = None

        self.manager.get_num_new_matched_tokens = answering
        original_build = self.manager.build_connector_meta

        def building(scheduler_output: Any) -> Any:
            self.record["offers"] += self.finish_offers
            self.record["evicted"] += self.finish_evictions
            self.finish_offers, self.finish_evictions = [], []
            before = self.store_cursors()
            meta = original_build(scheduler_output)
            for request_id, cursor in self.store_cursors().items():
                offered = range(before.get(request_id, 0), cursor)
                if offered:
                    self.record["offers"].append(StoreJob(request_id=request_id, offload_indices=tuple(offered)))
            return meta

        self.manager.build_connector_meta = building
        original_finished = self.manager.request_finished_all_groups

        def finishing(request: Any, block_ids: tuple[list[int], ...]) -> Any:
            pending = getattr(self.manager, "_pending_finished_stores", [])  # 0.34+: appended to, never replaced
            queued, evicted = len(pending), len(self.record["evicted"])
            result = original_finished(request, block_ids)
            made_room = self.record["evicted"][evicted:]
            del self.record["evicted"][evicted:]
            self.finished_blocks[request.request_id] = list(block_ids[0])
            for transfer in pending[queued:]:
                positions = tuple(block_ids[0].index(block) for block in transfer.gpu_block_ids)
                self.finish_offers.append(StoreJob(request_id=request.request_id, offload_indices=positions,
                                                   evicted=tuple(made_room)))
                self.finish_evictions += made_room
                made_room = []
            return result

        self.manager.request_finished_all_groups = finishing
        original_update = self.manager.update_connector_output

        def updating(connector_output: Any) -> None:
            manager = self.manager
            loading, storing = set(manager._reqs_to_load), set(manager._store_event_to_blocks)
            original_update(connector_output)
            self.record["completed_loads"] += [self.loads_in_flight.pop(request_id)
                                               for request_id in sorted(loading - manager._reqs_to_load.keys())]
            self.record["completed_stores"] += [job for event in sorted(storing - manager._store_event_to_blocks.keys())
                                                for job in self.store_jobs.pop(event)]

        self.manager.update_connector_output = updating
        wrap(self.cpu_pool, "get_cached_block", self._record_lookup)
        original_evict = self.cpu_pool._maybe_evict_cached_block

        def evicting(block: Any) -> bool:
            block_hash = block.block_hash
            evicted = original_evict(block)
            if evicted:
                self.record["evicted"].append(self.origin[self.plain_hash(block_hash)])
            return evicted

        self.cpu_pool._maybe_evict_cached_block = evicting

    def store_cursors(self) -> dict[str, int]:
        """Return how far the eager store has walked each request's blocks (stored or found stored)."""
        return {request_id: state.num_stored_blocks[0] for request_id, state in self.manager._reqs_to_store.items()}

    @staticmethod
    def empty_record() -> dict[str, Any]:
        return {"lookups": {}, "loads": [], "offers": [], "stores": [], "evicted": [], "completed_loads": [],
                "completed_stores": []}

    @staticmethod
    def plain_hash(key: Any) -> bytes:
        """Return the block hash of a CPU-pool key (a hash with its KV-cache group id appended)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        return get_block_hash(key)

    def _record_lookup(self, result: Any, block_hash: Any, group_ids: Any) -> None:
        if self.looking_up is not None:
            index = list(self.requests[self.looking_up].block_hashes).index(block_hash)
            self.record["lookups"].setdefault(self.looking_up, []).append(index)

    def observe_metadata(self, meta: Any) -> None:
        """Loads: the connector's load transfers of this event; stores: the blocks of its store event, by request."""
        record = self.record
        for request_id in meta.load_event_to_reqs.get(meta.load_event, ()) if meta.load_event >= 0 else ():
            gpu_blocks = self.manager._reqs_to_load[request_id].transfer_meta.gpu_block_ids
            positions = [self.block_ids(request_id).index(block) for block in gpu_blocks]
            load = LoadJob(request_id=request_id, offload_indices=tuple(positions), first_gpu_block=positions[0],
                           num_gpu_blocks=len(positions))
            record["loads"].append(load)
            self.loads_in_flight[request_id] = load
            self.transfers.issue(2 * meta.load_event + LOAD, False, gpu_blocks)
        if meta.store_event >= 0:
            refs = self.store_refs(meta.store_gpu_blocks)
            for ref in refs:
                self.origin.setdefault(self.requests[ref.request_id].block_hashes[ref.index], ref)
            by_request: dict[str, list[int]] = {}
            for ref in refs:
                by_request.setdefault(ref.request_id, []).append(ref.index)
            self.store_jobs[meta.store_event] = [StoreJob(request_id=r, offload_indices=tuple(i))
                                                 for r, i in by_request.items()]
            record["stores"] += self.store_jobs[meta.store_event]
            self.storing[meta.store_event] = refs
            self.transfers.issue(2 * meta.store_event + STORE, True, meta.store_gpu_blocks)

    def store_refs(self, gpu_blocks: list[int]) -> list[BlockRef]:
        """Name the GPU blocks of a store event by the request block each holds; a block that several requests hold
        (a prefix hit) is named after the request whose offer of this step covers it, be it a running request's or
        one queued at a finish. A finished request whose stores are in flight keeps its store state, block list
        included, but its blocks are free and may hold another request's by now: a finished request's blocks are
        those it held at its finish (`finished_blocks`), not that state's."""
        owner: dict[int, BlockRef] = {}
        for offer in self.record["offers"]:
            blocks = self.live_blocks(offer.request_id) or self.finished_blocks[offer.request_id]
            for index in offer.offload_indices:
                owner.setdefault(blocks[index], BlockRef(request_id=offer.request_id, index=index))
        for request_id in self.manager._reqs_to_store:
            for position, block in enumerate(self.live_blocks(request_id)):
                owner.setdefault(block, BlockRef(request_id=request_id, index=position))
        self.block_owner.update(owner)
        return [self.block_owner[block] for block in gpu_blocks]

    def live_blocks(self, request_id: str) -> list[int]:
        """Return the GPU blocks of a request the eager store tracks and that has not finished, else none."""
        state = self.manager._reqs_to_store.get(request_id)
        return [] if state is None or state.request.is_finished() else state.block_ids[0]

    def observe_connector(self, observation: dict[str, Any]) -> None:
        record, self.record = self.record, self.empty_record()
        observation.update(lookups={r: tuple(i) for r, i in record["lookups"].items()}, loads=tuple(record["loads"]),
                           store_offers=tuple(record["offers"]), stores=tuple(record["stores"]),
                           evicted=tuple(record["evicted"]), completed_loads=tuple(record["completed_loads"]),
                           completed_stores=tuple(record["completed_stores"]))

    def store_contents(self) -> StoreSnapshot:
        cached = {self.plain_hash(key) for key in self.cpu_pool.cached_block_hash_to_block._cache}
        ready = {self.origin[block_hash] for block_hash in cached}
        storing = {ref for event in self.manager._store_event_to_blocks for ref in self.storing[event]} - ready
        return StoreSnapshot(ready=frozenset(ready), storing=frozenset(storing))

    def stored_kv(self, block: BlockRef) -> torch.Tensor:
        """Return the bytes of the CPU block that vLLM's CPU block pool caches under the block's hash (XFER-DATA-3)."""
        cached = self.cpu_pool.get_cached_block(self.requests[block.request_id].block_hashes[block.index], [0])
        if cached is None:
            raise ValueError(f"vLLM's CPU block pool caches no block for {block!r}")
        return self.kv_tensors.read_store(cached[0].block_id, 1)

    def pinned_offload_blocks(self) -> int:
        return len({block for state in self.manager._reqs_to_load.values()
                    for block in state.transfer_meta.cpu_block_ids})

    def jobs_in_flight(self) -> int:
        return len(self.manager._store_event_to_blocks) + len(self.manager._reqs_to_load)
