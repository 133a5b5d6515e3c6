"""The reference engine in the adapter contract's vocabulary (`common.values`, chapter `conformance`).

What a step did, what the store holds and what is still allocated, as an adapter reports them: every offloaded
block named by the first request block that produced it (CONF-OBS-2). The reference adapter reports these, and the
offloading level's judge compares an adapter's reports with them.
"""

from __future__ import annotations

from kvconform.common.values import (
    BlockRef,
    LoadJob,
    MatchAnswer,
    ResourceUsage,
    StepObservation,
    StoreJob,
    StoreSnapshot,
)
from kvconform.reference.engine import Engine, StepResult


class Observer:
    """Reports what one reference engine does, as the adapter contract's values."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.refs: dict[bytes, BlockRef] = {}

    def step(self, result: StepResult) -> StepObservation:
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
                               for (r, i), evicted in zip(trace.store_offers, trace.offer_evictions, strict=True)),
            stores=tuple(StoreJob.model_construct(request_id=r, offload_indices=tuple(i), evicted=())
                         for r, i in trace.stores),
            evicted=tuple(map(self.block_ref, trace.evicted)),
            completed_loads=tuple(LoadJob.model_construct(request_id=r, offload_indices=tuple(i), first_gpu_block=first,
                                                          num_gpu_blocks=n)
                                  for r, i, first, n in trace.completed_loads),
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
            kv_events=tuple(result.kv_events),
        )

    def block_ref(self, key: bytes) -> BlockRef:
        """Return the implementation-neutral name of an offload key: the first request block that produced it."""
        ref = self.refs.get(key)
        if ref is None:
            request_id, index = self.engine.connector.key_origin[key]
            ref = self.refs[key] = BlockRef.model_construct(request_id=request_id, index=index)
        return ref

    def store_contents(self) -> StoreSnapshot:
        """Return the blocks the store holds, readable or still being stored (OFF-MGR-1)."""
        ready: set[BlockRef] = set()
        storing: set[BlockRef] = set()
        for key, block in self.engine.manager.contents():
            (ready if block.is_ready else storing).add(self.block_ref(key))
        return StoreSnapshot.model_construct(ready=frozenset(ready), storing=frozenset(storing))

    def resource_usage(self) -> ResourceUsage:
        """Return what the engine still holds (LIFE-LEAK-1)."""
        engine = self.engine
        return ResourceUsage(
            used_gpu_blocks=engine.kv.pool.num_blocks - 1 - engine.kv.pool.num_free_blocks,
            pinned_offload_blocks=engine.manager.num_pinned(),
            jobs_in_flight=engine.in_flight_job_count(),
            unfinished_requests=sum(1 for r in engine.requests.values() if not r.is_finished),
        )
