"""The reference adapter: the reference engine behind the adapter contract."""

from __future__ import annotations

from collections.abc import Callable

import torch

import kvconform
from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.values import (
    BlockRef,
    Capabilities,
    EngineConfig,
    LoadJob,
    MatchAnswer,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreJob,
    StoreSnapshot,
    TransferOutcome,
)
from kvconform.reference.connector import NO_DEVIATIONS, KnownDeviations
from kvconform.reference.engine import Engine, FollowedSchedule, StepResult


class ReferenceAdapter(KVConnectorAdapter):
    """Drives `kvconform.reference.engine.Engine`; supports every capability."""

    name = "reference"

    def __init__(self, device: torch.device | None = None, *,
                 engine: Callable[[EngineConfig, torch.device | None], Engine] = Engine) -> None:
        """`engine` builds the engine that each `start` runs: the reference `Engine`, or one a mutant assembles."""
        self.device = device
        self.build_engine = engine
        self.engine: Engine | None = None
        self.refs: dict[bytes, BlockRef] = {}

    def implementation_version(self) -> str:
        return kvconform.__version__

    def capabilities(self) -> Capabilities:
        return Capabilities(complete_in_step=True, reads_stored_kv=True)

    def start(self, config: EngineConfig) -> None:
        self.engine = self.build_engine(config, self.device)
        self.refs = {}

    def add_request(self, request: RequestSpec) -> None:
        self.engine.add_request(request)

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        return self.step_following(None, complete_transfers)

    def step_following(self, followed: FollowedSchedule | None, complete_transfers: TransferOutcome | None = None,
                       deviations: KnownDeviations = NO_DEVIATIONS) -> StepObservation:
        """Run one step that schedules as `followed` says and takes the known `deviations` (the reference judging
        another engine), or by its own policy."""
        outcome = None if complete_transfers is None else (complete_transfers.fail_loads, complete_transfers.fail_stores)
        return self.observe(self.engine.step(outcome, followed, deviations))

    def observe(self, result: StepResult) -> StepObservation:
        """Translate a reference step into the contract's vocabulary.

        The models are built unvalidated: they are right by construction, and the harness revalidates
        whatever an adapter under test returns (CONF-OBS-1).
        """
        trace = result.trace
        return StepObservation.model_construct(
            scheduled_tokens=result.scheduled_tokens,
            computed_tokens=result.computed_tokens,
            match_answers=tuple(MatchAnswer.model_construct(request_id=r, local_hit_tokens=local, external_tokens=ext,
                                                            load_async=a) for r, local, ext, a in trace.answers),
            lookups={r: tuple(indices) for r, indices in trace.lookups.items()},
            loads=tuple(LoadJob.model_construct(request_id=r, offload_indices=tuple(i), first_gpu_block=first,
                                                num_gpu_blocks=n) for r, i, first, n in trace.loads),
            store_offers=tuple(StoreJob.model_construct(request_id=r, offload_indices=tuple(i),
                                                        evicted=tuple(map(self.block_ref, evicted)))
                               for (r, i), evicted in zip(trace.store_offers, trace.offer_evictions)),
            stores=tuple(StoreJob.model_construct(request_id=r, offload_indices=tuple(i), evicted=())
                         for r, i in trace.stores),
            evicted=tuple(map(self.block_ref, trace.evicted)),
            completed_loads=tuple(LoadJob.model_construct(request_id=r, offload_indices=tuple(i), first_gpu_block=first,
                                                          num_gpu_blocks=n) for r, i, first, n in trace.completed_loads),
            completed_stores=tuple(StoreJob.model_construct(request_id=r, offload_indices=tuple(i), evicted=())
                                   for r, i in trace.completed_stores),
            flushed_stores=tuple(StoreJob.model_construct(request_id=r, offload_indices=tuple(i), evicted=())
                                 for r, i in trace.flushed_stores),
            touches=tuple(BlockRef.model_construct(request_id=r, index=i) for r, i in trace.touches),
            preempted=tuple(sorted(result.preempted)),
            promoted=dict(trace.promoted),
            finished=tuple(result.finished),
            freed=tuple(result.freed),
            forward_writes=frozenset(result.forward_writes),
            store_reads_in_flight=frozenset(result.store_reads_in_flight),
            loads_finished=tuple(result.reports.loads_finished),
            loads_failed=tuple(result.reports.loads_failed),
            free_delayed=tuple(result.reports.free_delayed),
            saves_finished=tuple(result.reports.saves_finished),
        )

    def block_ref(self, key: bytes) -> BlockRef:
        """Return the implementation-neutral name of an offload key: the first request block that produced it."""
        ref = self.refs.get(key)
        if ref is None:
            request_id, index = self.engine.connector.key_origin[key]
            ref = self.refs[key] = BlockRef.model_construct(request_id=request_id, index=index)
        return ref

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def preempt(self, request_id: str) -> None:
        self.engine.preempt(request_id)

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        return self.engine.reset_prefix_cache(reset_connector)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        self.engine.complete_transfers(fail_loads, fail_stores)

    def store_contents(self) -> StoreSnapshot:
        ready, storing = set(), set()
        for key, block in self.engine.manager.contents():
            (ready if block.is_ready else storing).add(self.block_ref(key))
        return StoreSnapshot.model_construct(ready=frozenset(ready), storing=frozenset(storing))

    def computed_kv(self, request_id: str) -> torch.Tensor:
        return self.engine.computed_kv(request_id)

    def stored_kv(self, block: BlockRef) -> torch.Tensor:
        return self.engine.stored_kv(block.request_id, block.index)

    def resource_usage(self) -> ResourceUsage:
        engine = self.engine
        return ResourceUsage(
            used_gpu_blocks=engine.kv.pool.num_blocks - 1 - engine.kv.pool.num_free_blocks,
            pinned_offload_blocks=engine.manager.num_pinned(),
            jobs_in_flight=engine.in_flight_job_count(),
            unfinished_requests=sum(1 for r in engine.requests.values() if not r.is_finished),
        )
