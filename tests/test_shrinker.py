"""The kit's own shrinker: a counterexample is a program that fails the same way when replayed (CONF-RUN-3)."""

from __future__ import annotations

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.reference_pd import ReferencePDAdapter
from kvconform.common.values import Capabilities, EngineConfig, RequestSpec
from kvconform.conformance import runner
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.mutants import MUTANTS
from kvconform.conformance.shrinker import Failure, Shrinker, size, step_runs, without_request

PROMPT = (0, 2, 0, 2) * 3
CONFIG = EngineConfig(num_gpu_blocks=16, block_size_factor=3, num_offload_blocks=4, eviction_policy="arc",
                      async_scheduling=True, max_num_batched_tokens=16)


def seed_scenario(noise: int) -> list[Call]:
    """vLLM's seed regression scenario, buried among `noise` unrelated requests: store, reset, skip-read repeat."""
    program = [Call("start", (CONFIG,))]
    for number in range(noise):
        program.append(Call("add_request", (RequestSpec(request_id=f"n{number}", prompt=(3, 1) * 10, max_tokens=3),)))
        program.append(Call("step"))
    program += [Call("add_request", (RequestSpec(request_id="first", prompt=PROMPT, max_tokens=2),)), Call("drain"),
                Call("reset_prefix_cache", (False,)),
                Call("add_request", (RequestSpec(request_id="skip", prompt=PROMPT, skip_reading_prefix_cache=True),)),
                Call("step")]
    return program


def test_shrunk_program_fails_the_same_way() -> None:
    """CONF-RUN-3: the shrunk program is smaller, plainer, and fails with the same clause when replayed."""
    session = Session(MUTANTS["skip-flag-ignored"].adapter)
    shrinker = Shrinker(session, Capabilities(), attempts=1000)
    found = shrinker.replay(seed_scenario(noise=4))
    assert Failure.of(found.violation) == Failure("OFF-READ-1")
    shrunk = shrinker.shrink(found)
    assert [call.operation for call in shrunk.program] == ["start", "add_request", "step"], shrunk.program
    assert shrunk.program[0].args[0].async_scheduling is False and shrunk.program[0].args[0].eviction_policy == "lru"
    assert Failure.of(shrinker.replay(shrunk.program).violation) == Failure("OFF-READ-1")


def test_the_violation_carries_the_program_that_produced_it() -> None:
    """The counterexample travels in the violation: the calls its execution ran, up to the one that failed; one that
    failed before the engine started carries the adapter calls made instead."""
    program = seed_scenario(noise=1)
    violation = replay(Session(MUTANTS["skip-flag-ignored"].adapter), program + [Call("drain")]).violation
    assert violation.program == program and violation.calls[:2] == ["adapter = factory()", "adapter.capabilities()"]

    class Refuses(ReferenceAdapter):
        def capabilities(self) -> Capabilities:
            raise RuntimeError("no capabilities")

    violation = replay(Session(Refuses), program).violation
    assert (violation.clause, violation.program, violation.calls) == (
        "CONF-CALL-1", [], ["adapter = factory()", "adapter.capabilities()"])


def test_shrinking_keeps_to_the_capabilities() -> None:
    """CONF-RUN-3: simplified engine settings stay within the adapter's capabilities and the run's scheduling."""
    session = Session(MUTANTS["skip-flag-ignored"].adapter, scheduling="async")
    shrinker = Shrinker(session, Capabilities(block_size_factors=(3,), eviction_policies=("arc",)), attempts=1000)
    config = shrinker.shrink(shrinker.replay(seed_scenario(noise=1))).program[0].args[0]
    assert (config.block_size_factor, config.eviction_policy, config.async_scheduling) == (3, "arc", True)


def test_budget_is_a_count_of_replays() -> None:
    """CONF-RUN-3: the shrinker stops after the profile's number of replays, so a budget shrinks alike on any machine;
    a larger budget shrinks further."""
    session = Session(MUTANTS["skip-flag-ignored"].adapter)

    def shrunk(attempts: int) -> tuple[list[Call], int]:
        shrinker = Shrinker(session, Capabilities(), attempts=attempts)
        return shrinker.shrink(shrinker.replay(seed_scenario(noise=4))).program, shrinker.replays

    (few, replays), (again, _), (more, _) = shrunk(6), shrunk(6), shrunk(1000)
    assert replays == 6
    assert few == again
    assert size(more) < size(few)


def test_safety_cap_cuts_shrinking_short_and_says_so() -> None:
    """CONF-RUN-3: past the wall-clock safety cap the shrinker returns what it has, and the message says so."""
    session = Session(MUTANTS["skip-flag-ignored"].adapter)
    shrinker = Shrinker(session, Capabilities(), attempts=1000, cap_seconds=0)
    found = shrinker.replay(seed_scenario(noise=4))
    shrunk = shrinker.shrink(found)
    assert shrunk.program == found.program
    assert "safety cap" in shrunk.violation.detail, shrunk.violation.detail


class FailsOnlyOnce(ReferenceAdapter):
    """Answers the first step that schedules tokens wrongly, in whichever engine it builds, and never again: a
    failure that does not replay."""

    failed = False

    def step(self, complete_transfers=None):
        observation = super().step(complete_transfers)
        if not FailsOnlyOnce.failed and observation.scheduled_tokens:
            FailsOnlyOnce.failed = True
            return observation.model_copy(update={"scheduled_tokens": {**observation.scheduled_tokens, "ghost": 1}})
        return observation


def test_nondeterministic_adapter_is_reported() -> None:
    """CONF-RUN-3: a failure that does not recur on replay is reported as found, and said to be nondeterministic."""
    result = runner.run(FailsOnlyOnce, "fails-only-once", "ci", seed=0)
    assert result.failed_clause == "SCHED-STEP-2", result.message
    assert "not deterministic" in result.message


def test_a_long_shrink_says_how_far_it_got(monkeypatch) -> None:
    """CONF-RUN-3: a shrink that lasts reports its replays and the smallest failing program so far, each time
    PROGRESS_SECONDS pass; the last report's program is no bigger than the first's."""
    from kvconform.conformance import shrinker as shrinking

    monkeypatch.setattr(shrinking, "PROGRESS_SECONDS", 0.0)
    lines: list[str] = []
    shrinker = Shrinker(Session(MUTANTS["skip-flag-ignored"].adapter), Capabilities(), attempts=1000,
                        on_progress=lines.append)
    shrinker.shrink(shrinker.replay(seed_scenario(noise=2)))
    assert lines and all(line.startswith("shrinking OFF-READ-1: ") for line in lines), lines
    calls = [int(line.split("requests, ")[1].split(" calls")[0]) for line in lines]
    assert calls == sorted(calls, reverse=True) and calls[-1] < len(seed_scenario(noise=2)), lines


def pair_scenario(noise: int) -> list[Call]:
    """A prefill forwarded to the consumer and read, buried among `noise` other prefills, each forwarded, the forward
    then aborted, and a plain request to the consumer."""
    def spec(request_id: str, max_tokens: int = 1) -> RequestSpec:
        return RequestSpec(request_id=request_id, prompt=PROMPT, max_tokens=max_tokens, cache_salt="tenant-a")

    program = [Call("start", (EngineConfig(block_size=4, num_gpu_blocks=64, block_size_factor=1,
                                           tensor_parallel_size=2),))]
    for number in range(noise):
        program += [Call("prefill", (spec(f"n{number}"),)), Call("step"),
                    Call("decode", (spec(f"m{number}", 2), f"n{number}")), Call("abort", (f"m{number}",))]
    program += [Call("add_request", (spec("plain"),)), Call("prefill", (spec("p"),)), Call("step"),
                Call("decode", (spec("d", 3), "p", {"remote_engine_id": "prefill-0"})), Call("step"),
                Call("complete_transfers", (False, False)), Call("step"), Call("step"), Call("drain")]
    return program


def test_dropping_a_prefill_drops_the_decodes_of_its_params_and_what_names_them() -> None:
    """A prefill goes with the decodes that forward its params, and an abort of such a decode with them; every call
    that creates a request counts as one (`size`)."""
    program = pair_scenario(noise=1)  # start, prefill n0, step, decode m0 of n0, abort m0, then plain, p and d
    assert size(program)[0] == 5
    assert without_request(program, "n0") == [program[0], program[2], *program[5:]]
    assert without_request(program, "m0") == [*program[:3], *program[5:]]


def test_a_pair_program_shrinks_to_the_requests_that_fail() -> None:
    """CONF-RUN-3 at the disaggregated level: the shrinker drops whole prefills and decodes, plain requests and the
    calls naming them, and simplifies a prefill with its decode: what is left is the one hand-over the mutant fails,
    with the params as the producer returned them."""
    session = Session(MUTANTS["pd-receive-reported-twice"].adapter)
    shrinker = Shrinker(session, ReferencePDAdapter().capabilities(), attempts=1000)
    found = shrinker.replay(pair_scenario(noise=3))
    assert Failure.of(found.violation) == Failure("PD-ONCE-1"), found.violation
    shrunk = shrinker.shrink(found)
    created = [call for call in shrunk.program if call.creates is not None]
    assert [call.operation for call in created] == ["prefill", "decode"], shrunk.program
    prefill, decode = (call.args[0] for call in created)
    assert len(created[1].args) == 2 and decode.max_tokens == 1, shrunk.program
    assert prefill.prompt == decode.prompt and len(prefill.prompt) < len(PROMPT) and prefill.cache_salt is None
    assert shrunk.program[0].args[0].tensor_parallel_size == 1
    assert Failure.of(shrinker.replay(shrunk.program).violation) == Failure("PD-ONCE-1")


def test_steps_in_a_row_shrink_to_a_drain() -> None:
    """Where the harness completes transfers, a drain may stand for steps in a row: an unending lease is shown by a
    prefill and one drain, not by the dozen steps it takes."""
    steps = [Call("step")] * 12
    program = [Call("start", (EngineConfig(block_size=4, num_gpu_blocks=16, block_size_factor=1),)),
               Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)), *steps]
    assert step_runs(program) == [(2, 14)] and step_runs([Call("step"), Call("complete_transfers", (False, False)),
                                                          Call("step")]) == []
    shrinker = Shrinker(Session(MUTANTS["pd-lease-never-ends"].adapter), ReferencePDAdapter().capabilities(),
                        attempts=1000)
    shrunk = shrinker.shrink(shrinker.replay(program))
    assert [call.operation for call in shrunk.program] == ["start", "prefill", "drain"], shrunk.program
    assert shrunk.failure.clause == "PD-LEASE-1"
