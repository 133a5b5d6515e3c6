"""The offloading level's judge: OffloadingManager-style connectors, judged per offloaded block (chapters 01 – 06).

The judge owns a reference engine, built by the session's `reference` factory, and steps it alongside the adapter as
the adapter scheduled (`schedule_of`): following the adapter's own schedule, the reference knows what the KV-cache
manager, the connector and the store must do, and the checks (`offloading_checks.py`) compare every step, the store
and the bytes with it. Where the run lists a known failure, the reference takes the adapter's own choice instead
(`deviations_of`), so that the example goes on past it (CONF-RUN-2).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvconform.common.values import (
    BlockRef,
    EngineConfig,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreSnapshot,
    TransferOutcome,
)
from kvconform.conformance.judging.judge import ClauseViolation, Run
from kvconform.conformance.judging.offloading_checks import Context, check_drained
from kvconform.reference.connector import KnownDeviations, OffloadConnectorScheduler
from kvconform.reference.engine import FollowedSchedule
from kvconform.reference.errors import InvalidCall
from kvconform.reference.observation import Observer
from kvconform.reference.request import RequestStatus


class OffloadingJudge:
    """Judges one execution at the offloading level, against the reference engine stepped alongside the adapter."""

    def __init__(self, run: Run, config: EngineConfig) -> None:
        self.run = run
        with self.referencing():
            self.engine = run.reference_engine(config)
            self.observer = Observer(self.engine)
        self.ctx = Context(config, run.requests, self.engine.requests, exercised=run.coverage)

    @property
    def connector(self) -> OffloadConnectorScheduler:
        """Return the reference engine's offload connector: the one connector the offloading level models."""
        connector = self.engine.connector
        if not isinstance(connector, OffloadConnectorScheduler):
            raise TypeError(f"the offloading level's reference engine has a {type(connector).__name__}, not an offload "
                            "connector")
        return connector

    @contextmanager
    def referencing(self) -> Iterator[None]:
        """Count the time of the block as the reference's (`RunStatistics.reference_seconds`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.run.timed_reference(time.perf_counter() - started)

    # --- the operations, run on the reference before the adapter ---------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        with self.referencing():
            self.engine.add_request(spec)

    def prefill(self, spec: RequestSpec) -> None:
        """Refuse: the reference engine is one engine, and a pair is judged at the disaggregated level alone."""
        raise InvalidCall("CONF-CAP-1", f"prefill({spec.request_id!r}): the offloading level judges one engine")

    def decode(self, spec: RequestSpec, params: dict[str, Any]) -> None:
        """Refuse: the reference engine is one engine, and a pair is judged at the disaggregated level alone."""
        raise InvalidCall("CONF-CAP-1", f"decode({spec.request_id!r}): the offloading level judges one engine")

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        with self.referencing():
            self.engine.complete_transfers(fail_loads, fail_stores)

    def abort(self, request_id: str) -> None:
        with self.referencing():
            self.engine.abort(request_id)

    def preempt(self, request_id: str) -> None:
        with self.referencing():
            self.engine.preempt(request_id)

    # --- the adapter's answers ----------------------------------------------------------------------

    def step_observed(self, actual: StepObservation, completed_in_step: TransferOutcome | None) -> None:
        """Judge a step: the adapter's observation and store against the reference's, following its schedule; the
        transfers the step was asked to complete complete in the reference's step too (CONN-STEP-4)."""
        run, ctx = self.run, self.ctx
        expected = self.follow(actual, completed_in_step)
        run.judge("adapter.step()", "step", ctx, expected, actual)
        with self.referencing():
            store = self.observer.store_contents()
        actual_store = run.call("store_contents")
        run.judge("adapter.store_contents()", "store", ctx, store, actual_store)
        if run.capabilities.reads_stored_kv:
            self.judge_stored_kv(actual, actual_store)
        ctx.previous_store = store
        ctx.previous_pinned = frozenset(self.engine.manager.pinned_keys())

    def follow(self, actual: StepObservation, completed_in_step: TransferOutcome | None) -> StepObservation:
        """Step the reference as the adapter scheduled, taking the adapter's choices where the run knows it deviates,
        and return what the reference observes; each deviation taken is recorded as its known failure (CONF-RUN-2)."""
        ctx, run = self.ctx, self.run
        ctx.followed = schedule_of(actual, [request.request_id for request in self.engine.running])
        deviations = deviations_of(actual, run.known_failures(), ctx.identity)
        with self.referencing():
            outcome = None if completed_in_step is None else (completed_in_step.fail_loads,
                                                              completed_in_step.fail_stores)
            result = self.engine.step(outcome, ctx.followed, deviations)
            expected = self.observer.step(result)
        ctx.facts = result.facts
        since = self.connector.store_differs_since
        for clause, what in result.trace.adopted:
            if since is not None and clause in DEVIATIONS_FOLLOWED["victims"]:
                what += f" (the store differing since {since})"
            violation = ClauseViolation(clause, f"adapter.step(): {what}")
            if not run.tolerates(violation):
                raise violation
            run.followed_deviation()
        return expected

    def judge_stored_kv(self, observation: StepObservation, store: StoreSnapshot) -> None:
        """Read the bytes of every block that a store completed in the step made readable, and judge them whether or
        not a load ever reads them (XFER-DATA-3)."""
        readable = self.ctx.identities(store.ready)
        for job in observation.completed_stores:
            for index in job.offload_indices:
                block = BlockRef(request_id=job.request_id, index=index)
                if self.ctx.identity(block) in readable:
                    self.run.judge(f"adapter.stored_kv({block!r})", "stored-data", self.ctx, block,
                                         self.run.call("stored_kv", block))

    def resident_kv(self, request_id: str, kv: torch.Tensor) -> None:
        """Judge a request's GPU bytes against the reference's count of computed tokens (XFER-DATA-1)."""
        self.run.judge(f"adapter.computed_kv({request_id!r})", "data", self.ctx, request_id, kv)

    def reset_answered(self, reset_connector: bool, answer: bool) -> None:
        """Judge the answer to a prefix-cache reset against the reference's (PFX-RESET-1)."""
        if reset_connector:  # the jobs in flight are discarded: their completions are ignored, not reported (OFF-MGR-8)
            self.ctx.jobs_in_flight.clear()
        with self.referencing():
            expected = self.engine.reset_prefix_cache(reset_connector)
        self.run.judge(f"adapter.reset_prefix_cache({reset_connector!r})", "reset", self.ctx, expected, answer)

    def drained(self, usage: ResourceUsage, waited: str) -> None:
        """Judge the drained engine: nothing left allocated, pinned or in flight (LIFE-LEAK-1, LIFE-LIVE-1)."""
        with self.referencing():
            expected = self.observer.resource_usage()
        check_drained(self.ctx, expected, waited)  # the reference drains too
        self.run.judge("adapter.resource_usage()", "drain", self.ctx, usage, waited)

    # --- where the requests are, as the reference has them (judge.EngineState) --------------------------

    def unfinished(self) -> list[str]:
        return sorted(request.request_id for request in (*self.engine.waiting, *self.engine.running))

    def loading(self) -> list[str]:
        return sorted(request.request_id for request in self.engine.waiting
                      if request.status is RequestStatus.WAITING_FOR_LOAD)

    def running(self) -> list[str]:
        return sorted(request.request_id for request in self.engine.running)

    def storing(self) -> list[str]:
        """Return the running requests whose stores are still in flight."""
        connector = self.connector
        return [request_id for request_id in self.running() if any(
            connector.jobs[job].is_store for job in connector.states[request_id].transfer_jobs)]

    def transfers_pending(self) -> bool:
        return bool(self.engine.in_flight_job_count())

    def stores_in_flight(self) -> bool:
        """Return True while a store job is in flight, a finished request's included."""
        return any(job.is_store for job in self.connector.jobs.values())

    def resident(self) -> list[str]:
        """Return the requests whose computed tokens' KV is in their GPU blocks: running, or with a load just done."""
        loaded = [request_id for request_id, success in self.engine.loads_done.items()
                  if success and not self.engine.requests[request_id].is_finished]
        return sorted({*self.running(), *loaded})

    def busy(self) -> bool:
        """Return True while the engine still has work for a step (SCHED-STEP-1) or a batch in flight."""
        return self.engine.has_work() or self.engine.in_flight is not None

    def idle(self, usage: ResourceUsage) -> bool:
        """Return True: the reference knows every job in flight, so once it is not busy the drain is over."""
        return True


DEVIATIONS_FOLLOWED = {"lookups": {"OFF-LOOKUP-1"}, "offers": {"OFF-STORE-1"}, "victims": {"OFF-LRU-1", "OFF-ARC-1"}}
"""Which adapter choices the reference takes in place of its own, and the known failures that make it take them."""


def deviations_of(observation: StepObservation, known: Collection[str],
                  identity: Callable[[BlockRef], bytes]) -> KnownDeviations:
    """Return the adapter's choices in a step that the reference takes where the run lists their clause as a known
    failure (`DEVIATIONS_FOLLOWED`), so that the example goes on past them (CONF-RUN-2)."""
    follows = {choice for choice, clauses in DEVIATIONS_FOLLOWED.items() if clauses & set(known)}
    return KnownDeviations(
        lookups={a.request_id: observation.lookups.get(a.request_id, ()) for a in observation.match_answers}
        if "lookups" in follows else None,
        offers={offer.request_id: offer.offload_indices for offer in observation.store_offers}
        if "offers" in follows else None,
        victims={offer.request_id: tuple(map(identity, offer.evicted)) for offer in observation.store_offers}
        if "victims" in follows else None)


def schedule_of(observation: StepObservation, running: Collection[str]) -> FollowedSchedule:
    """Return the scheduling choices an adapter's step shows, for the reference to follow (SCHED-STEP-2).

    `running` are the requests running when the step began. Waiting requests were considered in the order they
    were asked for matches, or taken up after their load (`promoted`, each placed after the answers given before
    it), scheduled or not; a request scheduled that was neither had been taken up in an earlier step and held its
    blocks since, so it came first (SCHED-ORDER-1). A request asked with an asynchronous load was admitted if the
    step left it with computed tokens or a load job.
    """
    resumed_or_admitted = [request_id for request_id in observation.scheduled_tokens if request_id not in running]
    loading = {load.request_id for load in observation.loads}
    admitted = set(resumed_or_admitted) | {
        answer.request_id for answer in observation.match_answers
        if answer.load_async
        and (observation.computed_tokens.get(answer.request_id, 0) or answer.request_id in loading)}
    asked = {answer.request_id for answer in observation.match_answers}
    considered = [r for r in resumed_or_admitted if r not in asked and r not in observation.promoted]
    for index, answer in enumerate(observation.match_answers):
        considered += [request_id for request_id, answers_before in observation.promoted.items()
                       if answers_before == index]
        if answer.request_id not in considered:  # else a failed load that freed its blocks, asked when taken up
            considered.append(answer.request_id)
    considered += [request_id for request_id, answers_before in observation.promoted.items()
                   if answers_before >= len(observation.match_answers)]
    return FollowedSchedule(scheduled_tokens=dict(observation.scheduled_tokens), considered=tuple(considered),
                            admitted=frozenset(admitted), preempted=frozenset(observation.preempted))
