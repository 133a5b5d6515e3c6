"""The disaggregated level (chapter `disaggregated`, issue 23): the reference pair conforms at every tensor-parallel
size, each P/D mutant fails its own clause on a program that shows its bug, and bad input gets a clear answer."""

from __future__ import annotations

import time

import pytest

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.reference_pd import ReferencePDAdapter
from kvconform.common.forwarding import forwarded_params
from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    EngineStep,
    RequestSpec,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance import options, runner, scenarios
from kvconform.conformance.execution import DEFAULT_DRAIN_TIMEOUT, Execution, Session, replay
from kvconform.conformance.judging import disaggregated
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.judging.levels import judged_levels
from kvconform.conformance.mutants import MUTANTS
from kvconform.conformance.operations import Call, render
from kvconform.reference.disaggregated import LEASE_STEPS, ConsumerConnector, ProducerConnector, RankOutput

PROMPT = (1, 2, 3, 0) * 3


def config(size: int = 1, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(block_size=4, num_gpu_blocks=16, block_size_factor=1, tensor_parallel_size=size,
                        async_scheduling=async_scheduling)


def hand_over(size: int = 1, fail: bool = False, steps: int = 3, override: dict | None = None) -> list[Call]:
    """Return a program that prefills one prompt, forwards its params and completes the read, then steps."""
    return [Call("start", (config(size),)), Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)),
            Call("step"), Call("decode", (RequestSpec(request_id="d", prompt=PROMPT, max_tokens=3), "p",
                                          *([override] if override else []))),
            Call("step"), Call("complete_transfers", (fail, False)), *[Call("step")] * steps]


PROGRAMS: dict[str, list[Call]] = {
    "pd-frees-before-read": [Call("start", (config(),)),
                             Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)), *[Call("step")] * 4],
    "pd-lease-never-ends": [Call("start", (config(),)), Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)),
                            *[Call("step")] * (LEASE_STEPS + 8)],
    "pd-wrong-remote-block-ids": hand_over()[:3],
    "pd-aborted-prefill-held": [Call("start", (config(async_scheduling=True),)),
                                Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)), Call("step"),
                                Call("abort", ("p",)), Call("step")],
    "pd-receive-reported-twice": hand_over(),
    "pd-receive-never-reported": [*hand_over(), Call("drain")],
    "pd-notification-lost": hand_over(steps=8),
    "pd-malformed-params-accepted": hand_over(override={"remote_engine_id": None}),
    "pd-load-ignores-local-hit": [Call("start", (config(),)), Call("add_request", (RequestSpec(request_id="c",
                                                                                               prompt=PROMPT),)),
                                  Call("drain"), *hand_over()[1:]],
    "pd-failure-reported-as-success": hand_over(fail=True),
    "pd-rank-reads-other-heads": hand_over(size=2),
    "pd-reads-wrong-blocks": hand_over(),
    "pd-aggregates-one-rank": hand_over(size=2),
    "pd-failed-read-lost-in-aggregation": hand_over(size=2, fail=True),
}
"""Per P/D mutant, a program that shows its bug; each ends with the pair drained below."""


def run(adapter: type, program: list[Call], drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> ClauseViolation | None:
    """Run `program` and a last drain, waiting up to `drain_timeout` seconds for a pair on its own clock, on a fresh
    `adapter`; return the violation it ended with, if any."""
    execution = Execution(Session(adapter, drain_timeout=drain_timeout))
    execution.begin()
    try:
        for call in [*program, Call("drain")]:
            execution.apply(call)
    except ClauseViolation as violation:
        return violation
    finally:
        execution.close()
    return None


def test_every_pair_mutant_has_a_program() -> None:
    assert set(PROGRAMS) == {name for name, row in MUTANTS.items() if "disaggregated" in row.levels}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_reference_pair_passes_what_each_mutant_fails(name: str) -> None:
    """The program conforms on the reference pair, and the mutant fails it under the first clause its row names."""
    assert run(ReferencePDAdapter, PROGRAMS[name]) is None
    violation = run(MUTANTS[name].adapter, PROGRAMS[name])
    assert violation is not None and violation.clause == MUTANTS[name].clauses[0], (name, violation)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_each_pair_program_printed_runs_against_its_mutant(name: str) -> None:
    """A pair's counterexample printed as Python (`render`: the program the kit ran, up to the call that failed) runs
    on a fresh mutant pair, every call accepted: the program's `decode(request, prefill_id, params)` is the
    adapter's."""
    failing = replay(Session(MUTANTS[name].adapter), [*PROGRAMS[name], Call("drain")])
    assert failing.failure.clause in MUTANTS[name].clauses
    adapter = MUTANTS[name].adapter()
    try:
        exec(render(failing.program), {"adapter": adapter})
    finally:
        adapter.close()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_reference_pair_conforms_at_each_tensor_parallel_size(size: int) -> None:
    """PD-*: the smoke profile passes with every rank count the pair runs, and judges the pair's clauses."""
    result = runner.run(ReferencePDAdapter, "reference-pd", "smoke", tensor_parallel_size=size)
    assert result.passed, f"[{result.failed_clause}] {result.message}\n{result.counterexample}"
    assert result.levels == ("disaggregated",)
    assert {"PD-PARAMS-1", "PD-HOLD-1", "PD-TP-1", "PD-LEASE-1"} <= {c for c, n in result.coverage.items() if n}


def test_the_bundled_scenario_passes_on_the_pair_and_catches_a_lost_notification() -> None:
    """The scenario's expectations hold on reference-pd; a consumer whose notification is lost keeps the producer's
    blocks held past the read (PD-NOTIFY-1)."""
    scenario = scenarios.load("prefilled-request-decoded")
    assert scenarios.judge(scenario, Session(ReferencePDAdapter)).outcome == "pass"
    verdict = scenarios.judge(scenario, Session(MUTANTS["pd-notification-lost"].adapter))
    assert (verdict.outcome, verdict.clause) == ("fail", "PD-NOTIFY-1"), verdict
    refused = scenarios.judge(scenario, Session(ReferenceAdapter))
    assert refused.outcome == "refused" and "disaggregated" in refused.detail


def test_a_pair_is_judged_at_its_own_level_alone() -> None:
    assert judged_levels(ReferencePDAdapter().capabilities()) == {"disaggregated"}
    assert Call("prefill", (RequestSpec(request_id="p", prompt=(1,)),)).unsupported(ReferenceAdapter().capabilities())


def test_malformed_and_misdirected_params_get_a_verdict_not_a_traceback() -> None:
    """PD-PARAMS-2, PD-FAIL-1: params missing a field are answered no load; params naming another engine, request or
    blocks fail the read; the reference pair passes each."""
    for override in ({"do_remote_prefill": None}, {"remote_block_ids": None}, {"remote_engine_id": "elsewhere"},
                     {"remote_request_id": "nobody"}, {"remote_block_ids": [9]}):
        assert run(ReferencePDAdapter, hand_over(override=override)) is None, override


def test_bad_input_is_one_line() -> None:
    """A tensor-parallel size the adapter does not run, or a decode of a prefill never sent, is refused in one line."""
    with pytest.raises(options.UsageProblem, match="runs tensor-parallel sizes 1, 2, 4, not 3"):
        options.prepare("reference-pd", tensor_parallel_size=3, database="none")
    with pytest.raises(options.UsageProblem, match="not 2"):
        options.prepare("reference", tensor_parallel_size=2, database="none")
    scenario = scenarios.Scenario(EngineConfig(block_size=4, num_gpu_blocks=16, block_size_factor=1),
                                  level="disaggregated").call("decode", RequestSpec(request_id="d", prompt=(1,)), "p")
    with pytest.raises(scenarios.ScenarioError, match="no prefill sent to the producer"):
        scenarios.check(scenario, Session(ReferencePDAdapter))


class WallClockProducer(ProducerConnector):
    """The reference producer with its lease on the wall clock, as vLLM NIXL's: it begins when `request_finished`
    answers and ends at the first step that polls it after `WALL_LEASE` seconds."""

    def request_finished(self, request_id: str, block_ids: list[int], params: dict | None,
                         finished_normally: bool) -> tuple[bool, dict | None]:
        answer = super().request_finished(request_id, block_ids, params, finished_normally)
        if request_id in self.held:
            self.held[request_id].expires = time.monotonic() + WALL_LEASE  # type: ignore[assignment]
        return answer

    def step(self) -> RankOutput:
        self.clock = time.monotonic() - 1  # type: ignore[assignment]  # the reference's step advances it by one
        return super().step()


WALL_LEASE = 0.5


class SlowStepsPair(ReferencePDAdapter):
    """The reference pair on the connector's clock (`lease_seconds`), its steps taking `pauses[i]` seconds after the
    producer's part of step i (the consumer's part: vLLM's forward, NIXL's handshake), else PAUSE."""

    PAUSE = 0.02
    pauses: dict[int, float] = {}

    def __init__(self) -> None:
        super().__init__(producer=WallClockProducer)
        self.steps = 0

    def capabilities(self) -> Capabilities:
        return super().capabilities().model_copy(update={"lease_steps": None, "lease_seconds": WALL_LEASE})

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        observation = super().step(complete_transfers)
        time.sleep(self.pauses.get(self.steps, self.PAUSE))
        self.steps += 1
        return observation


def unread_hold(steps: int) -> list[Call]:
    return [Call("start", (config(),)), Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)),
            *[Call("step")] * steps]


def test_a_lease_on_the_connectors_clock_runs_from_the_call_of_the_step_that_began_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PD-HOLD-1: the step in which the producer's request finishes is slow after the lease began (the consumer's
    part); the producer ends the unread hold at its lease, counted from inside that step: no failure. Measured from
    the step's return, the hold ended before its lease, neither read nor expired."""
    monkeypatch.setattr(SlowStepsPair, "pauses", {0: 0.35})
    assert run(SlowStepsPair, unread_hold(int(WALL_LEASE / SlowStepsPair.PAUSE) + 10)) is None


def test_a_hold_ended_within_two_steps_of_the_first_step_past_its_lease_is_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PD-LEASE-1: a step called before the lease ended outlasts the lease and its slack; the producer ends the hold
    in the next step, the first to poll it past the lease: no failure. A hold still there past that (the lease that
    never ends) fails."""
    monkeypatch.setattr(disaggregated, "LEASE_SLACK_SECONDS", 0.2)
    monkeypatch.setattr(SlowStepsPair, "pauses", {1: 0.5 * WALL_LEASE, 2: WALL_LEASE + 0.3})
    assert run(SlowStepsPair, unread_hold(8)) is None
    monkeypatch.setattr(WallClockProducer, "step", lambda self: ProducerConnector.step(self))  # the lease never ends
    violation = run(SlowStepsPair, unread_hold(8))
    assert violation is not None and violation.clause == "PD-LEASE-1", violation


class HeartbeatPair(ReferencePDAdapter):
    """The reference pair whose producer renews a hold's lease while a consumer read of it is planned or in flight, as
    vLLM NIXL's consumer heartbeats do (`nixl/base_worker.py` `_handle_heartbeat`)."""

    def start(self, config: EngineConfig) -> None:
        super().start(config)
        producer, consumer = self.sides["producer"].connector, self.sides["consumer"].connector
        assert isinstance(producer, ProducerConnector) and isinstance(consumer, ConsumerConnector)
        step = producer.step

        def renewing_step() -> RankOutput:
            waiting = {load.params["remote_request_id"] for load in (*consumer.pending.values(),
                                                                     *consumer.in_flight.values())}
            for request_id, held in producer.held.items():
                if request_id in waiting:
                    held.expires = max(held.expires, producer.clock + 1 + producer.lease_steps)
            return step()

        producer.step = renewing_step  # type: ignore[method-assign]


def test_a_lease_renewed_while_a_consumer_waits_to_read_is_allowed() -> None:
    """PD-LEASE-1 (MAY): a producer may keep a hold past its lease while a consumer request forwarded its params
    waits to read it; once the read is reported, the lease runs again. The reference pair ends it at its lease and
    passes too; the lease that never ends still fails."""
    program = [*hand_over(steps=0)[:5], *[Call("step")] * (LEASE_STEPS + 8), Call("complete_transfers", (False, False)),
               *[Call("step")] * 3]
    assert run(HeartbeatPair, program) is None
    assert run(ReferencePDAdapter, program) is None
    violation = run(MUTANTS["pd-lease-never-ends"].adapter, PROGRAMS["pd-lease-never-ends"])
    assert violation is not None and violation.clause == "PD-LEASE-1", violation


class TrailingReceivesPair(SlowStepsPair):
    """The reference pair on the connector's clock whose consumer reports each receive `DELAY` steps after it finished,
    as the consumer of a producer that writes the KV itself (push) reports it once the write's notification came: the
    producer has ended its hold by then."""

    DELAY = 6

    def __init__(self) -> None:
        super().__init__()
        self.trailing: list[tuple[int, EngineStep]] = []

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        observation = super().step(complete_transfers)
        pair = observation.disaggregated
        assert pair is not None
        consumer = pair.consumer
        if consumer.finished_recving:
            self.trailing.append((self.steps + self.DELAY, consumer))
        due = [step for at, step in self.trailing if at <= self.steps]
        self.trailing = [(at, step) for at, step in self.trailing if at > self.steps]
        reported = {field: tuple(item for step in due for item in getattr(step, field))
                    for field in ("finished_recving", "failed_recving")}
        ranks = tuple(rank.model_copy(update={field: tuple(item for step in due for item in
                                                            getattr(step.ranks[index], field))
                                              for field in ("finished_recving", "failed_recving")})
                      for index, rank in enumerate(consumer.ranks))
        consumer = consumer.model_copy(update={**reported, "ranks": ranks})
        return observation.model_copy(update={"disaggregated": pair.model_copy(update={"consumer": consumer})})


def test_a_receive_reported_after_the_producer_ended_its_hold_is_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """PD-HOLD-1 (MAY): on the connector's clock, the consumer's report of a receive may trail the producer's end of
    the hold by the time reports take to cross the pair (a producer that pushes ends it when its write completed); it
    failed when it trailed by more than one step. A report that never comes within NOTIFY_SECONDS still fails."""
    program = [*hand_over(steps=0)[:5], Call("complete_transfers", (False, False)), *[Call("step")] * 12]
    assert run(TrailingReceivesPair, program) is None
    monkeypatch.setattr(disaggregated, "NOTIFY_SECONDS", 0.05)
    violation = run(TrailingReceivesPair, program)
    assert violation is not None and violation.clause == "PD-HOLD-1", violation


class AbortNotifyingPair(ReferencePDAdapter):
    """The reference pair whose consumer, when a request forwarded params is aborted before it was scheduled, notifies
    the producer that it will not read, as vLLM NIXL's does (`nixl/pull_scheduler.py`:222-233): the producer ends
    the hold then, before its lease."""

    def __init__(self) -> None:
        super().__init__()
        self.forwarded: dict[str, dict] = {}

    def decode(self, request: RequestSpec, prefill_id: str, params: dict | None = None) -> None:
        self.forwarded[request.request_id] = forwarded_params(self.returned.get(prefill_id), params)
        super().decode(request, prefill_id, params)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        params = self.forwarded.pop(request_id, None)
        producer = self.sides["producer"].connector
        if params is not None and isinstance(producer, ProducerConnector):
            producer.transport.notifications[producer.engine_id] += [(params["remote_request_id"], rank)
                                                                     for rank in range(producer.world_size)]


def test_a_hold_given_up_by_an_aborted_consumer_request_may_end_before_its_lease() -> None:
    """PD-HOLD-1 agrees with PD-ABORT-1: a producer ends a hold on the notification that the consumer request that was
    to read it was aborted; it failed as a hold ended unread (vLLM NIXL 0.34, ci profile). A hold ended early with no
    such abort still fails (pd-frees-before-read)."""
    program = [*hand_over(steps=0)[:3], Call("step"), hand_over(steps=0)[3], Call("abort", ("d",)),
               *[Call("step")] * 4]
    assert run(AbortNotifyingPair, program) is None
    violation = run(MUTANTS["pd-frees-before-read"].adapter, PROGRAMS["pd-frees-before-read"])
    assert violation is not None and violation.clause == "PD-HOLD-1", violation
