"""Past a known failure the example goes on (CONF-RUN-2): the reference takes the implementation's own lookups,
offers or eviction victims where the run lists their clause, and every other clause is still judged."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import pytest

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.vllm import runtime
from kvconform.conformance import baseline, options, runner
from kvconform.conformance.baseline import Baseline, Entry
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.mutants import MUTANTS
from kvconform.reference.connector import OffloadConnectorScheduler
from kvconform.reference.engine import Engine


class CappedLookupConnector(OffloadConnectorScheduler):
    """Looks the store up only to the request's last token but one, as vLLM's SimpleCPUOffloadConnector caps its hit
    (`max_hit_len`): a full last block is never looked up (a known OFF-LOOKUP-1 deviation of that connector)."""

    def _lookup(self, state, lookup_end=None):
        request = state.request
        capped = (request.num_tokens - 1) // self.offloaded_block_size
        return super()._lookup(state, capped if lookup_end is None else min(lookup_end, capped))


def capped_lookup_adapter() -> ReferenceAdapter:
    return ReferenceAdapter(engine=functools.partial(Engine, connector=CappedLookupConnector))


def run(adapter, known: dict[str, str]) -> runner.RunResult:
    listed = [Entry(clause, reason, rare=True) for clause, reason in known.items()]
    return runner.run(adapter, "deviating", profile="ci", baseline=Baseline(listed))


@pytest.mark.long
@pytest.mark.parametrize(("adapter", "clauses"), [
    (MUTANTS["lru-touch-ignored"].adapter, ("OFF-LRU-1",)),
    (capped_lookup_adapter, ("OFF-LOOKUP-1",)),
    (MUTANTS["decoded-blocks-not-offloaded"].adapter, ("OFF-STORE-1", "OFF-READ-3")),
])
def test_a_known_deviation_is_followed_and_the_example_goes_on(adapter, clauses):
    """Each deviation fails its clauses when they are not listed; listed, the run passes, records them as known
    failures, and judges steps after them."""
    assert run(adapter, {}).failed_clause in clauses
    listed = run(adapter, dict.fromkeys(clauses, "the implementation's own choice"))
    assert listed.passed and set(listed.known_failures) <= set(clauses), listed.message
    assert listed.steps_after_known_failure > 0


def test_a_followed_offer_still_fails_the_skip_read_rule():
    """Offers are followed where OFF-STORE-1 is listed, but a skip-read request that offers less than it must breaks
    OFF-READ-3, which the run does not list: the seed rule's second half is still judged."""
    result = run(MUTANTS["skip-returns-early"].adapter, {"OFF-STORE-1": "offers a step late"})
    assert result.failed_clause == "OFF-READ-3", result.message


def test_a_victim_the_store_must_keep_is_not_followed():
    """An eviction of a block a load still reads is not a victim the reference takes: listing the policy's clauses
    does not hide OFF-MGR-3."""
    known = {"OFF-LRU-1": "another order", "OFF-ARC-1": "another order"}
    assert run(MUTANTS["evicts-pinned"].adapter, known).failed_clause == "OFF-MGR-3"


@pytest.mark.vllm
@pytest.mark.skipif(runtime.installed_version() != "0.23.0",
                    reason="needs vLLM 0.23.0 (its own environment): kvconform install-vllm 0.23.0")
def test_a_scheduler_deviation_is_listed_once_for_every_adapter_on_its_release() -> None:
    """CONF-RUN-2: 0.23's scheduler race (SCHED-ALLOC-1), listed once in the release's file, is met as listed by a
    run of vllm-offloading, whose own file does not list it; without the release's file the program fails it."""
    from kvconform.adapters.vllm.offloading import VllmOffloadingAdapter

    folder = resources.files("kvconform.adapters.vllm")
    text = folder.joinpath("deviations", "vllm-offloading-0.23.0-SCHED-ALLOC-1.json").read_text(encoding="utf-8")
    program = [Call.from_json(operation) for operation in json.loads(text)["program"]]
    own = folder.joinpath("known-failures", "vllm-offloading-0.23.0.txt")
    alone = replay(Session(VllmOffloadingAdapter, baseline=baseline.load(own)), program).violation
    assert alone is not None and alone.clause == "SCHED-ALLOC-1", alone
    run = options.prepare("vllm-offloading", known_failures_path=Path(str(own)), database="none")
    assert run.known_failures_files[0].endswith("vllm-0.23.0.txt") and "SCHED-ALLOC-1" in run.known_failures
    listed = baseline.Baseline(list(run.known_entries))
    assert replay(Session(VllmOffloadingAdapter, baseline=listed), program).violation is None
    assert listed.met == {"SCHED-ALLOC-1 /for which the free blocks do not hold/": 1}, listed.met
