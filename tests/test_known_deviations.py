"""Past a known failure the example goes on (CONF-RUN-2): the reference takes the implementation's own lookups,
offers or eviction victims where the run lists their clause, and every other clause is still judged."""

from __future__ import annotations

import functools

import pytest

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.conformance import runner
from kvconform.conformance.baseline import Baseline
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
    return runner.run(adapter, "deviating", profile="ci", baseline=Baseline(dict(known), rare=set(known)))


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
    assert listed.statistics.steps_after_known_failure > 0


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
