"""The connector level (chapter 08): its history model, its positive control, and its judge on the adapter's own
schedule, with no reference engine stepped alongside."""

from __future__ import annotations

import pytest

from faulty_adapters import answers_a_synchronous_full_hit
from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.conformance import runner
from kvconform.conformance.execution import Call, Execution, Session, replay
from kvconform.conformance.judging.connector import MASKED_FAULTS, ConnectorJudge
from kvconform.conformance.judging.events import EventsJudge
from kvconform.conformance.judging.offloading import OffloadingJudge
from kvconform.conformance.mutants import MUTANTS, FinishesEarlyEngine, black_box
from kvconform.reference.engine import Engine
from kvconform.reference.kv_history import KVHistory

PROMPT = (1, 2, 3, 0) * 6


def drain(adapter: KVConnectorAdapter) -> None:
    """Complete every transfer and step until the adapter holds nothing."""
    for _ in range(32):
        adapter.complete_transfers(False, False)
        adapter.step()
        if not any(adapter.resource_usage().model_dump().values()):
            return
    raise AssertionError("the adapter did not drain")


def external_hit_after_local_reset(adapter: KVConnectorAdapter, first: RequestSpec) -> int:
    """Run `first` to the end, reset the local prefix cache only, send its prompt again (reading allowed) and
    return the external tokens the connector offers it: the positive control of KVC-SAVE-1."""
    adapter.start(EngineConfig(block_size_factor=1, num_offload_blocks=32))
    adapter.add_request(first)
    drain(adapter)
    assert adapter.reset_prefix_cache(False)
    adapter.add_request(RequestSpec(request_id="again", prompt=first.prompt, cache_salt=first.cache_salt,
                                    lora_name=first.lora_name))
    answers = [a for a in adapter.step().match_answers if a.request_id == "again"]
    return answers[0].external_tokens or 0


@pytest.mark.parametrize("skip_read", [False, True])
def test_saved_prefix_hits_after_a_local_reset(skip_read: bool) -> None:
    """KVC-SAVE-1: with room to spare, what a request computed — a skip-read one's too — is offered again."""
    first = RequestSpec(request_id="first", prompt=PROMPT, skip_reading_prefix_cache=skip_read)
    assert external_hit_after_local_reset(ReferenceAdapter(), first) == len(PROMPT)


def test_positive_control_fails_a_connector_that_does_not_save_skip_read_requests() -> None:
    """KVC-SAVE-1's control tells PR #44592's first draft (skip-read requests never stored) from the fix."""
    first = RequestSpec(request_id="first", prompt=PROMPT, skip_reading_prefix_cache=True)
    assert external_hit_after_local_reset(MUTANTS["skip-returns-early"].adapter(), first) == 0


def test_history_derives_the_tokens_an_engine_decodes() -> None:
    """The judge knows every request's tokens without asking the engine: they equal the reference engine's outputs."""
    engine = Engine(EngineConfig())
    engine.add_request(RequestSpec(request_id="r", prompt=(2, 1), max_tokens=4, cache_salt="a"))
    while engine.has_work() or engine.in_flight is not None:
        engine.step()
    history = KVHistory()
    history.add("r", (2, 1), 4, "a", None)
    assert history.prefix("r", 6) == engine.requests["r"].tokens


def test_history_keeps_tenants_apart() -> None:
    """KVC-HIT-1: a prefix one tenant computed is not computed for another, nor is a longer one."""
    history = KVHistory()
    history.add("a", PROMPT, 1, "tenant-a", None)
    history.add("b", PROMPT, 1, "tenant-b", None)
    history.add("c", PROMPT, 1, "tenant-a", None)
    history.record_computed("a", 8)
    assert history.was_computed("c", 8) and history.was_computed("c", 4)
    assert not history.was_computed("b", 8) and not history.was_computed("c", 12)


def test_connector_level_alone_steps_no_reference() -> None:
    """An adapter reporting the connector level only is judged on its own schedule: no reference engine runs."""
    execution = Execution(Session(black_box(ReferenceAdapter)))
    assert execution.begin().levels == ("connector",)
    execution.apply(Call("start", (EngineConfig(),)))
    assert [type(judge) for judge in execution.judges] == [ConnectorJudge]


def test_both_levels_are_judged_the_deeper_first() -> None:
    """An adapter reporting the offloading level is judged at both levels, the offloading level first: its failures
    name the block and the cause."""
    execution = Execution(Session(ReferenceAdapter))
    execution.begin()
    execution.apply(Call("start", (EngineConfig(),)))
    assert [type(judge) for judge in execution.judges] == [OffloadingJudge, ConnectorJudge, EventsJudge]


def test_the_offloading_judge_follows_the_reference_it_is_given() -> None:
    """The offloading level's reference engine is injected (`Session.reference`), not wired in: judged against one
    that finishes requests an output early, the reference adapter fails LIFE-FIN-1."""
    program = [Call("start", (EngineConfig(),)), Call("add_request", (RequestSpec(request_id="r", prompt=PROMPT,
                                                                                 max_tokens=3),)), Call("drain")]
    assert replay(Session(ReferenceAdapter), program).violation is None
    assert replay(Session(ReferenceAdapter, reference=FinishesEarlyEngine), program).violation.clause == "LIFE-FIN-1"


@pytest.mark.parametrize("profile", ["smoke", pytest.param("ci", marks=pytest.mark.long)])
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_reference_conforms_at_the_connector_level_alone(scheduling: str, profile: str) -> None:
    """The reference passes judged as a black box, and the run says which level it judged."""
    result = runner.run(black_box(ReferenceAdapter), "reference", profile, scheduling=scheduling)
    assert result.passed, f"[{result.failed_clause}] {result.message}\n{result.counterexample}"
    assert result.levels == ("connector",)
    assert not any(clause.startswith(("OFF-", "XFER-", "SCHED-")) for clause in result.coverage)
    assert {"KVC-DATA-1", "KVC-HIT-1", "KVC-ASYNC-1", "KVC-LIVE-1"} <= set(result.coverage)


def reload_after_reset() -> list[Call]:
    """A prompt computed, the local prefix cache reset, the same prompt again: the connector offers it all."""
    return [Call("start", (EngineConfig(block_size_factor=1, num_offload_blocks=32),)),
            Call("add_request", (RequestSpec(request_id="r0", prompt=PROMPT),)), Call("drain"),
            Call("reset_prefix_cache", (False,)), Call("add_request", (RequestSpec(request_id="r1", prompt=PROMPT),)),
            Call("drain")]


def test_a_synchronous_full_hit_fails_kvc_match_1_where_the_engine_takes_it() -> None:
    """KVC-MATCH-1: a synchronous load of every token leaves none to compute; taken as given, it fails the run."""
    violation = replay(Session(answers_a_synchronous_full_hit(masked=False)), reload_after_reset()).violation
    assert violation is not None and violation.clause == "KVC-MATCH-1", violation
    assert f"covering all of its {len(PROMPT)} tokens" in violation.detail


def test_a_synchronous_full_hit_the_scheduler_replaced_is_a_finding_not_a_failure() -> None:
    """Issue 22: the same answer, replaced by the engine's scheduler before use, is reported as a finding that names
    its kind and where it fails (`MASKED_FAULTS`), and the run passes."""
    session = Session(answers_a_synchronous_full_hit(masked=True))
    assert replay(session, reload_after_reset()).violation is None
    finding = session.findings["KVC-MATCH-1"]
    assert f"covering all of its {len(PROMPT)} tokens" in finding and "masked by this release's scheduler" in finding
    assert f"as a synchronous hit of every token it fails on {MASKED_FAULTS['synchronous hit of every token'][1]}" \
        in finding, finding

