"""The disaggregated level's judge: a producer/consumer pair of engines, judged on their own schedules (chapter
`disaggregated`).

A pair's adapter steps both engines and reports each one's connector facts (`StepObservation.disaggregated`).
The judge follows both schedules as the connector level's judge follows one — the requests' ids are unique across
the pair, so one `ScheduleTrace` and one KV history span both engines, and the consumer's loaded bytes are judged
against the KV the producer computed for the same prompt (PD-DATA-1) — and, joined by the params the harness
forwarded, checks the P/D clauses first, then every connector-level check.

Time is the connector's own where the adapter says so (`Capabilities.lease_seconds`: the lease on the wall clock),
else the producer's steps (`Capabilities.lease_steps`, a harness-clocked pair).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconform.common.forwarding import block_ids, valid_params
from kvconform.common.values import (
    EngineStep,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance.judging.connector import ConnectorJudge
from kvconform.conformance.judging.judge import ClauseViolation, check

LEASE_SLACK_STEPS = 2
"""Steps past a lease that a hold may take to end: its release is reported by the step that processes it, one step
later with async scheduling (PD-LEASE-1)."""

LEASE_SLACK_SECONDS = 2.0
"""Seconds past a lease on the connector's clock that a hold may take to end: the producer polls its lease from its
steps (PD-LEASE-1)."""

NOTIFY_STEPS = 3
"""Steps after the consumer reported a read by every rank within which the producer must end the hold (PD-NOTIFY-1):
the notification crosses the pair in the next step, and its release is processed a step later with async
scheduling."""

NOTIFY_SECONDS = 2.0
"""On the connector's clock, the seconds the notification may also take (PD-NOTIFY-1)."""


@dataclass
class Hold:
    """A producer request whose free is delayed for the consumer's read (PD-HOLD-1)."""

    step: int
    """The step its request finished in."""
    called: float
    """When that step was called (`judge.Run.step_called`): the earliest its lease can have begun."""
    started: float
    """When that step returned (the run's clock, `Run.now`): the latest its lease can have begun."""
    block_ids: tuple[int, ...]
    read_at: tuple[int, float] | None = None
    """The step and time a consumer reported, by every rank, a successful read of it (PD-NOTIFY-1)."""
    lease_step: int | None = None
    """On the connector's clock, the first step called once the lease had surely ended: the producer ends the hold
    when a step of its polls the lease, and reports it in that step or, with async scheduling, a later one
    (PD-LEASE-1)."""
    claimed: tuple[int, float] | None = None
    """The step and time a consumer request forwarded its params last waited to read it: the producer may renew the
    lease until then (PD-LEASE-1, vLLM NIXL's heartbeats)."""

    def lease_from(self) -> tuple[int, float]:
        """Return the step and time the lease must be counted from at the latest: the hold's start, or its last
        claim."""
        return self.claimed or (self.step, self.started)


@dataclass
class PairTrace:
    """The pair's protocol state, joined by the params the harness forwarded."""

    producer: set[str] = field(default_factory=set)
    """Requests sent to the producer (`prefill`)."""
    aborted: set[str] = field(default_factory=set)
    decodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Consumer requests sent with params (`decode`) -> the params forwarded."""
    must_fail: set[str] = field(default_factory=set)
    """Consumer requests whose read must be reported failed: params naming an engine or blocks the producer does not
    hold, or a load the harness failed (PD-FAIL-1)."""
    completed: set[str] = field(default_factory=set)
    """Consumer requests whose read the harness completed, or failed, and which are not reported yet."""
    holds: dict[str, Hold] = field(default_factory=dict)
    released_unread: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Holds ended before any consumer rank reported their read or their lease ended -> the step and time (PD-HOLD-1):
    a producer that writes into the consumer's blocks (push) ends its hold before the consumer reports the receive."""
    released: set[str] = field(default_factory=set)
    """Producer requests whose hold has ended."""
    reads: dict[str, int] = field(default_factory=dict)
    """Producer requests -> the step a consumer rank first reported a successful read of them."""
    ranks_seen: dict[tuple[str, str, str], set[int]] = field(default_factory=dict)
    """(engine, sending|recving, request) -> the ranks that reported it since the engine last saw it finished."""
    rank_failed: set[tuple[str, str]] = field(default_factory=set)
    """(engine, request): some rank reported the receive failed since the engine last saw it finished."""
    received: set[str] = field(default_factory=set)
    """Consumer requests whose receive the consumer has reported finished (PD-ONCE-1)."""
    loaded: set[str] = field(default_factory=set)
    """Consumer requests whose read was reported successful: their bytes are the producer's (PD-DATA-1)."""
    preempted: set[str] = field(default_factory=set)
    """Requests preempted and not scheduled since: they hold no KV."""
    answered: set[str] = field(default_factory=set)
    """Consumer requests sent with params whose first answer was judged (PD-LOAD-1, PD-PARAMS-2): a later one, after a
    preemption, is the connector's to give as it likes (vLLM NIXL clears `do_remote_prefill` once it planned the
    read)."""


@dataclass
class DisaggregatedJudge(ConnectorJudge):
    """Judges a producer/consumer pair (`judge.Judge`): the P/D checks, then the connector level's."""

    pair: PairTrace = field(default_factory=PairTrace)
    producer_id: str | None = None
    """The producer's engine id, from its first step."""

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def prefill(self, spec: RequestSpec) -> None:
        """A request to the producer: it must hand its KV over when it finishes (PD-PARAMS-1)."""
        self.add_request(spec)
        self.pair.producer.add(spec.request_id)

    def decode(self, spec: RequestSpec, params: dict[str, Any]) -> None:
        """A request to the consumer with forwarded params: its read must fail where the params lead nowhere
        (PD-FAIL-1)."""
        self.add_request(spec)
        self.pair.decodes[spec.request_id] = params
        if valid_params(params) and not self.reads_held_blocks(params):
            self.pair.must_fail.add(spec.request_id)

    def reads_held_blocks(self, params: Mapping[str, Any]) -> bool:
        """Return True if params name the producer, a request it holds, and exactly that request's blocks."""
        hold = self.pair.holds.get(params["remote_request_id"])
        return (self.producer_id is not None and params["remote_engine_id"] == self.producer_id
                and hold is not None and block_ids(params["remote_block_ids"]) == hold.block_ids)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.pair.aborted.add(request_id)

    def preempt(self, request_id: str) -> None:
        super().preempt(request_id)
        self.pair.preempted.add(request_id)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """The harness completes the consumer's reads in flight, or fails them: each failed one must be reported failed
        (PD-FAIL-1); one completed before is no longer in flight."""
        in_flight = self.trace.loading & self.pair.decodes.keys() - self.pair.completed
        if fail_loads:
            self.pair.must_fail |= in_flight
        self.pair.completed |= in_flight

    def step_observed(self, observation: StepObservation, completed_in_step: TransferOutcome | None) -> None:
        """Judge the pair's facts (P/D clauses), then the step at the connector level, then follow it; the reads the
        step completed inside it, those it admitted too, are no longer in flight."""
        pair = observation.disaggregated
        if pair is None:
            raise ClauseViolation("CONF-OBS-1", "adapter.step(): an adapter of the disaggregated level must "
                                                "report each engine's facts (StepObservation.disaggregated), and "
                                                "reported none")
        if self.producer_id is None:
            self.producer_id = pair.producer.engine_id
        self.gather_ranks(pair.producer, pair.consumer)
        self.run.judge("adapter.step()", "disaggregated", self, observation, pair.producer, pair.consumer)
        super().step_observed(observation, completed_in_step)
        self.follow_pair(observation, pair.producer, pair.consumer)
        if completed_in_step is not None:
            self.complete_transfers(completed_in_step.fail_loads, False)

    def resident_kv(self, request_id: str, kv: torch.Tensor) -> None:
        """Judge a loaded consumer request's bytes against the producer's (PD-DATA-1, PD-TP-1), then at the connector
        level."""
        if request_id in self.pair.loaded:
            self.run.judge(f"adapter.computed_kv({request_id!r})", "disaggregated-data", self, request_id, kv)
        super().resident_kv(request_id, kv)

    def drained(self, usage: ResourceUsage, waited: str) -> None:
        self.run.judge("adapter.resource_usage()", "disaggregated-drain", self, usage, waited)
        super().drained(usage, waited)

    def busy(self) -> bool:
        return super().busy() or bool(self.pair.holds)

    def transfers_pending(self) -> bool:
        return super().transfers_pending() or bool(self.pair.holds)

    def elapsed(self, since_step: int, since: float, limit_steps: int | None, limit_seconds: float | None,
                slack: float = 0.0) -> bool:
        """Return True once a span that began at `since_step` / `since` has passed the limit on the adapter's clock:
        steps (the step being judged is `trace.steps + 1`), or seconds."""
        if limit_seconds is not None:
            return self.run.now() - since > limit_seconds + slack
        return limit_steps is not None and self.trace.steps + 1 - since_step > limit_steps + slack

    def gather_ranks(self, producer: EngineStep, consumer: EngineStep) -> None:
        """Count each rank's reports of the step, before the checks judge what the engines saw of them (PD-TP-1)."""
        for name, engine in (("producer", producer), ("consumer", consumer)):
            for rank, report in enumerate(engine.ranks):
                for kind, ids in (("sending", report.finished_sending), ("recving", report.finished_recving)):
                    for request_id in ids:
                        self.pair.ranks_seen.setdefault((name, kind, request_id), set()).add(rank)
                self.pair.rank_failed |= {(name, request_id) for request_id in report.failed_recving}

    def follow_pair(self, observation: StepObservation, producer: EngineStep, consumer: EngineStep) -> None:
        """Advance the pair's state past a judged step (the connector level's trace has already moved on)."""
        pair, step, now = self.pair, self.trace.steps, self.run.now()
        for request_id in settled_unread_holds(self, consumer):
            del pair.released_unread[request_id]
        for name, engine in (("producer", producer), ("consumer", consumer)):
            for kind, finished in (("sending", engine.finished_sending), ("recving", engine.finished_recving)):
                for request_id in finished:
                    pair.ranks_seen.pop((name, kind, request_id), None)
            pair.rank_failed -= {(name, request_id) for request_id in engine.finished_recving}
        pair.answered |= {answer.request_id for answer in observation.match_answers
                          if answer.request_id in pair.decodes and answer.external_tokens is not None}
        pair.preempted = (pair.preempted | set(observation.preempted)) - set(observation.scheduled_tokens)
        for request_id, blocks in producer.held.items():
            if request_id not in pair.holds and request_id in producer.params:
                pair.holds[request_id] = Hold(step, self.run.step_called, now, tuple(blocks))
        waiting = {params["remote_request_id"] for decode, params in pair.decodes.items()
                   if valid_params(params) and decode in self.trace.unfinished and decode not in pair.received}
        lease = self.run.capabilities.lease_seconds
        for request_id, held in pair.holds.items():
            if request_id in waiting:
                held.claimed, held.lease_step = (step, now), None
            over = lease is not None and self.run.step_called - held.lease_from()[1] > lease
            if over and held.lease_step is None:
                held.lease_step = step
        for request_id in producer.finished_sending:
            pair.released.add(request_id)
            hold = pair.holds.pop(request_id, None)
            if hold is not None and hold.read_at is None and not self.lease_over(hold):
                pair.released_unread[request_id] = (step, now)
        for request_id in set(consumer.finished_recving) - set(consumer.failed_recving):
            params = pair.decodes.get(request_id)
            if params is not None and valid_params(params):
                pair.loaded.add(request_id)
                remote = params["remote_request_id"]
                pair.reads.setdefault(remote, step)
                if remote in pair.holds and pair.holds[remote].read_at is None:
                    pair.holds[remote].read_at = (step, now)
                elif remote in pair.released_unread or remote in pair.released:
                    self.exercise("PD-NOTIFY-1")  # the notifications ended the hold before every rank's report came
        for report in consumer.ranks:  # a read any rank reported: the producer may have its notification already
            for request_id in set(report.finished_recving) - set(report.failed_recving):
                params = pair.decodes.get(request_id)
                if params is not None and valid_params(params):
                    pair.reads.setdefault(params["remote_request_id"], step)
        pair.received |= set(consumer.finished_recving)
        pair.completed -= set(consumer.finished_recving)
        pair.loaded -= set(observation.finished)

    def lease_over(self, hold: Hold) -> bool:
        """Return True once a hold's lease may have ended (one step early on the harness's clock: the lease counts the
        step its request finished in; from the call of that step on the connector's)."""
        return self.elapsed(hold.step, hold.called, self.lease_steps, self.run.capabilities.lease_seconds)

    @property
    def lease_steps(self) -> int | None:
        """The steps a harness-clocked lease runs after the step its request finished in (it counts that step)."""
        steps = self.run.capabilities.lease_steps
        return None if steps is None else steps - 2

    def lease_overdue(self, hold: Hold) -> bool:
        """Return True once a hold must have ended: past its lease by the slack, counted from the step its request
        finished in or the last a consumer request waited to read it; on the connector's clock, from that step's
        return, and more than LEASE_SLACK_STEPS steps after the first step called once the lease was over."""
        capabilities = self.run.capabilities
        step, started = hold.lease_from()
        if capabilities.lease_seconds is None:
            return self.elapsed(step, started, self.lease_steps, None, LEASE_SLACK_STEPS + 2)
        return (self.elapsed(step, started, None, capabilities.lease_seconds, LEASE_SLACK_SECONDS)
                and hold.lease_step is not None and self.trace.steps + 1 - hold.lease_step > LEASE_SLACK_STEPS)


def _fault(clause: str, message: str) -> ClauseViolation:
    return ClauseViolation(clause, message)


# --- each step: ranks, params, holds, reads ---------------------------------------------------------------


@check("PD-ONCE-1", kind="disaggregated")
def check_reported_once(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                        consumer: EngineStep) -> None:
    """The consumer reports each receive finished once, for a read it started; the producer ends each hold once."""
    pair = judge.pair
    for request_id in consumer.finished_recving:
        judge.exercise("PD-ONCE-1")
        if request_id in pair.received:
            raise _fault("PD-ONCE-1", f"the consumer reported the receive of {request_id!r} finished again")
        if request_id not in pair.decodes:
            raise _fault("PD-ONCE-1", f"the consumer reported a receive of {request_id!r}, which was sent no params")
    for request_id in producer.finished_sending:
        judge.exercise("PD-ONCE-1")
        if request_id not in pair.holds:
            raise _fault("PD-ONCE-1", f"the producer ended the hold of {request_id!r}, which it did not hold "
                                      "(ended twice, or never delayed)")


@check("PD-TP-1", kind="disaggregated")
def check_rank_aggregation(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                           consumer: EngineStep) -> None:
    """Each engine reports one output per rank; it sees a transfer finished only once every rank reported it, and a
    receive a rank failed surfaces as failed with that report."""
    size = judge.tensor_parallel_size
    for name, engine in (("producer", producer), ("consumer", consumer)):
        if len(engine.ranks) != size:
            raise _fault("PD-TP-1", f"the {name} reported {len(engine.ranks)} rank outputs for tensor_parallel_size "
                                    f"{size}")
        seen = judge.pair.ranks_seen
        for kind, finished in (("sending", engine.finished_sending), ("recving", engine.finished_recving)):
            complete = {key[2] for key, ranks in seen.items() if key[:2] == (name, kind) and len(ranks) == size}
            if finished or complete:
                judge.exercise("PD-TP-1")
            early = sorted(set(finished) - complete)
            if early:
                ranks = {request_id: sorted(seen.get((name, kind, request_id), ())) for request_id in early}
                raise _fault("PD-TP-1", f"the {name} saw {early} finished {kind}, but only rank(s) {ranks} of "
                                        f"{size} reported them")
            missed = sorted(complete - set(finished))
            if missed:
                raise _fault("PD-TP-1", f"every one of the {name}'s {size} rank(s) reported {missed} finished "
                                        f"{kind}, but the engine did not see them finished")
        failed_ranks = {request_id for engine_name, request_id in judge.pair.rank_failed if engine_name == name}
        surfaced = set(engine.finished_recving) & failed_ranks
        lost = sorted(surfaced - set(engine.failed_recving))
        if lost:
            raise _fault("PD-TP-1", f"a rank of the {name} reported the receive of {lost} failed, but the engine saw "
                                    "it finished without the failure")


@check("PD-ABORT-1", kind="disaggregated")
def check_aborted_prefill(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                          consumer: EngineStep) -> None:
    """A producer request aborted before it finished does not delay its free."""
    held = sorted((set(producer.held) | set(observation.free_delayed)) & judge.pair.aborted & judge.pair.producer
                  - judge.pair.holds.keys())
    if judge.pair.aborted & judge.pair.producer:
        judge.exercise("PD-ABORT-1")
    if held:
        raise _fault("PD-ABORT-1", f"the producer holds the blocks of {held}, aborted before it finished: no consumer "
                                   "will read them")


@check("PD-PARAMS-1", kind="disaggregated")
def check_returned_params(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                          consumer: EngineStep) -> None:
    """A producer request that finished normally delays its free and returns params naming the producer, itself,
    exactly the blocks it holds, and the tensor-parallel size."""
    for request_id in sorted(set(observation.finished) & judge.pair.producer - judge.pair.aborted):
        if request_id in judge.pair.preempted and request_id not in observation.scheduled_tokens:
            continue  # preempted, its output still in flight: it finished holding no KV to hand over
        judge.exercise("PD-PARAMS-1")
        params = producer.params.get(request_id)
        held = producer.held.get(request_id)
        if held is None or request_id not in observation.free_delayed:
            raise _fault("PD-PARAMS-1", f"producer request {request_id!r} finished without delaying its free: its "
                                        "blocks are gone before any consumer reads them")
        wanted = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": producer.engine_id,
                  "remote_request_id": request_id, "tp_size": judge.tensor_parallel_size}
        wrong = {name: (params or {}).get(name, "<missing>") for name, value in wanted.items()
                 if (params or {}).get(name, "<missing>") != value}
        if params is None or wrong:
            raise _fault("PD-PARAMS-1", f"producer request {request_id!r} returned params {params!r}: "
                                        f"{wrong or 'none'} where {wanted} are due")
        named = block_ids(params.get("remote_block_ids"))
        if named != tuple(held):
            raise _fault("PD-PARAMS-1", f"producer request {request_id!r} returned remote_block_ids "
                                        f"{params.get('remote_block_ids')!r}, but holds blocks {list(held)}")


@check("PD-PARAMS-2", "PD-LOAD-1", kind="disaggregated")
def check_consumer_answers(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                           consumer: EngineStep) -> None:
    """A consumer request with malformed params is answered no external tokens and never waits; one with valid params
    is answered the prompt past its local hit, as one asynchronous load."""
    answered = set(judge.pair.answered)
    for answer in observation.match_answers:
        params = judge.pair.decodes.get(answer.request_id)
        if params is None or answer.request_id in answered:
            continue
        if answer.external_tokens is not None:
            answered.add(answer.request_id)
        got = (answer.external_tokens, answer.load_async)
        if not valid_params(params):
            judge.exercise("PD-PARAMS-2")
            if got != (0, False):
                raise _fault("PD-PARAMS-2", f"consumer request {answer.request_id!r} came with malformed params "
                                            f"{params!r}, yet was answered {got}, not (0, False): it must compute "
                                            "its prompt locally")
            continue
        judge.exercise("PD-LOAD-1")
        count = len(judge.requests[answer.request_id].prompt) - answer.local_hit_tokens
        if got != ((count, True) if count > 0 else (0, False)):
            raise _fault("PD-LOAD-1", f"consumer request {answer.request_id!r} with a local hit of "
                                      f"{answer.local_hit_tokens} was answered {got}, not ({count}, True): the prompt "
                                      "past the hit as one asynchronous load")


@check("PD-FAIL-1", kind="disaggregated")
def check_failed_receives(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                          consumer: EngineStep) -> None:
    """A read of an unknown engine, of blocks the producer does not hold, or one failed in transit is reported failed
    with its finished receive, and leaves no loaded tokens counted as computed."""
    stray = sorted(set(consumer.failed_recving) - set(consumer.finished_recving))
    if stray:
        raise _fault("PD-FAIL-1", f"the consumer reported the receive of {stray} failed without its finished receive")
    for request_id in consumer.finished_recving:
        if request_id not in judge.pair.must_fail:
            continue
        judge.exercise("PD-FAIL-1")
        if request_id not in consumer.failed_recving:
            params = judge.pair.decodes.get(request_id)
            raise _fault("PD-FAIL-1", f"the consumer reported the read of {request_id!r} finished, not failed, though "
                                      f"it had to fail (params {params!r}; the producer {judge.producer_id!r} holds "
                                      f"{ {r: list(h.block_ids) for r, h in judge.pair.holds.items()} }, or the "
                                      "harness failed the read)")


@check("PD-HOLD-1", kind="disaggregated")
def check_holds(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                consumer: EngineStep) -> None:
    """The producer neither writes nor gives up a held request's blocks, and ends a hold only after a consumer read it,
    the consumer request that was to read it was aborted (its notification, PD-ABORT-1), or its lease ended: at the
    latest one step before the consumer reported the read, as the reports cross the pair; on the connector's clock,
    NOTIFY_SECONDS before (a producer that writes the KV itself reports its write done while the consumer's report of
    it is on its way)."""
    pair = judge.pair
    for request_id, hold in pair.holds.items():
        judge.exercise("PD-HOLD-1")
        reused = sorted(set(hold.block_ids) & producer.forward_writes)
        if reused and request_id not in producer.finished_sending:
            raise _fault("PD-HOLD-1", f"the producer's forward wrote blocks {reused} held for {request_id!r}, "
                                      "before its consumer read them")
        if request_id in producer.held and tuple(producer.held[request_id]) != hold.block_ids:
            raise _fault("PD-HOLD-1", f"the producer holds blocks {list(producer.held[request_id])} for "
                                      f"{request_id!r}, not the {list(hold.block_ids)} it returned")
        if request_id not in producer.held and request_id not in producer.finished_sending:
            raise _fault("PD-HOLD-1", f"the producer gave up the blocks of {request_id!r} without ending its hold")
    freed = sorted(set(observation.freed) & pair.holds.keys() - set(producer.finished_sending))
    if freed:
        raise _fault("PD-HOLD-1", f"the producer freed the held blocks of {freed} before their hold ended")
    notify_seconds = NOTIFY_SECONDS if judge.run.capabilities.lease_seconds is not None else None
    settled = settled_unread_holds(judge, consumer)
    for request_id, (step, ended) in pair.released_unread.items():
        if request_id not in settled and judge.elapsed(step, ended, 1, notify_seconds):
            raise _fault("PD-HOLD-1", f"the producer ended the hold of {request_id!r} in step {step}, neither read by "
                                      "a consumer, nor given up by an aborted one, nor at the end of its lease")


def settled_unread_holds(judge: DisaggregatedJudge, consumer: EngineStep) -> set[str]:
    """Return the holds ended before any read that a consumer has since read, in this step by some rank or before, or
    given up by aborting the request that was to read them: their early end was the producer's right (PD-HOLD-1)."""
    pair = judge.pair
    read_now = {params.get("remote_request_id") for decode, params in pair.decodes.items()
                if any(decode in report.finished_recving and decode not in report.failed_recving
                       for report in consumer.ranks)}
    abandoned = {params.get("remote_request_id") for decode, params in pair.decodes.items() if decode in pair.aborted}
    return {request_id for request_id in pair.released_unread
            if request_id in pair.reads or request_id in read_now or request_id in abandoned}


@check("PD-LEASE-1", "PD-NOTIFY-1", kind="disaggregated")
def check_hold_ends(judge: DisaggregatedJudge, observation: StepObservation, producer: EngineStep,
                    consumer: EngineStep) -> None:
    """A hold no consumer read ends with its lease; one every consumer rank read ends on their notifications."""
    capabilities = judge.run.capabilities
    for request_id, hold in judge.pair.holds.items():
        if request_id in producer.finished_sending:
            read = hold.read_at is not None or any(
                params.get("remote_request_id") == request_id for decode, params in judge.pair.decodes.items()
                if decode in consumer.finished_recving and decode not in consumer.failed_recving)
            if read:
                judge.exercise("PD-NOTIFY-1")
            continue
        if hold.read_at is not None:
            judge.exercise("PD-NOTIFY-1")
            step, when = hold.read_at
            late_seconds = NOTIFY_SECONDS if capabilities.lease_seconds is not None else None
            if judge.trace.steps + 1 - step > NOTIFY_STEPS and (
                    late_seconds is None or judge.run.now() - when > late_seconds):
                raise _fault("PD-NOTIFY-1", f"every consumer rank read {request_id!r} in step {step}, yet the "
                                            f"producer still holds its blocks {judge.trace.steps + 1 - step} steps "
                                            "later: their notifications did not end the hold")
        judge.exercise("PD-LEASE-1")
        if judge.lease_overdue(hold):
            lease = (f"{capabilities.lease_seconds:g} s" if capabilities.lease_seconds is not None
                     else f"{capabilities.lease_steps} steps")
            raise _fault("PD-LEASE-1", f"the producer still holds the blocks of {request_id!r}, finished in step "
                                       f"{hold.step}, past its lease of {lease}")


# --- bytes ------------------------------------------------------------------------------------------------


@check("PD-DATA-1", "PD-TP-1", kind="disaggregated-data")
def check_loaded_bytes(judge: DisaggregatedJudge, request_id: str, kv: torch.Tensor) -> None:
    """A consumer request whose read succeeded holds the KV the producer computed for its prompt, byte for byte; where
    only some ranks' heads differ, those ranks moved the wrong share (PD-TP-1)."""
    judge.exercise("PD-DATA-1")
    num_tokens = judge.trace.computed_tokens.get(request_id, 0)
    expected = judge.history.expected_kv(request_id, num_tokens, judge.config.token_width, kv.dtype)
    if kv.shape == expected.shape and torch.equal(kv, expected):
        return
    size, remote = judge.tensor_parallel_size, judge.pair.decodes[request_id].get("remote_request_id")
    if kv.shape == expected.shape and size > 1:
        share = judge.config.token_width // size
        wrong = [rank for rank in range(size)
                 if not torch.equal(kv[:, rank * share:(rank + 1) * share],
                                    expected[:, rank * share:(rank + 1) * share])]
        if len(wrong) < size:
            raise _fault("PD-TP-1", f"consumer request {request_id!r}: the heads of rank(s) {wrong} of {size} are not "
                                    f"the KV producer request {remote!r} computed; the other ranks' are")
    raise _fault("PD-DATA-1", f"consumer request {request_id!r}: its {num_tokens} computed tokens' KV is not what "
                              f"producer request {remote!r} computed for that prompt ({judge.story(request_id)})")


# --- once the pair is drained ---------------------------------------------------------------------------------


@check("PD-ONCE-1", "PD-LEASE-1", "PD-ABORT-1", kind="disaggregated-drain")
def check_pair_drained(judge: DisaggregatedJudge, usage: ResourceUsage, waited: str) -> None:
    """Once drained, every read the consumer started is reported, and the producer holds nothing."""
    pair = judge.pair
    unreported = sorted(judge.trace.loading & pair.decodes.keys() - pair.received)
    if unreported:
        raise _fault("PD-ONCE-1", f"the consumer never reported the receive of {unreported} after {waited}")
    if pair.holds:
        aborted = sorted(pair.holds.keys() & pair.aborted)
        clause = "PD-ABORT-1" if aborted else "PD-LEASE-1"
        raise _fault(clause, f"the producer still holds the blocks of {sorted(pair.holds)} after {waited}")
    if usage.used_gpu_blocks and pair.aborted:
        raise _fault("PD-ABORT-1", f"{usage.used_gpu_blocks} GPU blocks still held after {waited}, with requests "
                                   f"{sorted(pair.aborted)} aborted on one side")
