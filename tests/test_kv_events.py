"""The events level (chapter `kv-events`): the reference publishes what it serves, the router model replays it, and
bad events get a verdict naming the event and the step, never a traceback."""

from __future__ import annotations

import pytest

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.kv_events import EventFormatError, parse_event
from kvconform.common.values import EngineConfig, RequestSpec, StepObservation
from kvconform.conformance import report, runner
from kvconform.conformance.judging.router import Router, RouterError

GOOD_HASH = "ab" * 16


def stored(**fields) -> dict:
    return {"type": "BlockStored", "block_hashes": [GOOD_HASH], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
            "block_size": 4, "lora_name": None, "medium": "GPU", **fields}


@pytest.mark.parametrize("raw, why", [
    ({"type": "BlockEvicted", "block_hashes": [GOOD_HASH]}, "unknown event type 'BlockEvicted'"),
    (stored(block_hashes=["ab" * 8]), "block_hashes.0"),
    (stored(token_ids=[1, 2]), "carries 2 token ids"),
    (stored(medium="NVMe"), "medium"),
    ("BlockStored", "not a mapping"),
])
def test_malformed_event_is_a_format_error(raw, why):
    """EVT-FORMAT-1: an unknown type, a hash of the wrong length, token ids that are not whole blocks, an unknown
    medium, a value that is no event: each is refused, saying why."""
    with pytest.raises(EventFormatError, match=why):
        parse_event(raw)


def test_router_refuses_a_removal_of_a_block_never_announced():
    """EVT-ORDER-1: the router removes only what it holds; a re-store after a removal is held again."""
    router = Router()
    router.apply(parse_event(stored()))
    router.apply(parse_event({"type": "BlockRemoved", "block_hashes": [GOOD_HASH], "medium": "GPU"}))
    assert not router.holds("GPU", GOOD_HASH)
    with pytest.raises(RouterError) as removed_twice:
        router.apply(parse_event({"type": "BlockRemoved", "block_hashes": [GOOD_HASH], "medium": "GPU"}))
    assert removed_twice.value.clause == "EVT-ORDER-1"
    router.apply(parse_event(stored()))
    assert router.run_held("GPU", [GOOD_HASH, "cd" * 16]) == 1


def test_reference_announces_what_it_caches_and_stores():
    """EVT-STORE-1, EVT-CHAIN-1: the reference announces each GPU block it caches and each offloaded block, one
    BlockStored of its GPU-block hashes chained on the block before, once readable."""
    adapter = ReferenceAdapter()
    adapter.start(EngineConfig(block_size_factor=2))
    adapter.add_request(RequestSpec(request_id="r0", prompt=tuple(range(17))))
    first = adapter.step()
    adapter.complete_transfers(False, False)
    second = adapter.step()
    gpu = [parse_event(e) for e in first.kv_events]
    assert [(e.medium, len(e.block_hashes), e.parent_block_hash) for e in gpu] == [("GPU", 4, None)]
    cpu = [parse_event(e) for e in second.kv_events if e["medium"] == "CPU"]
    assert [e.block_hashes for e in cpu] == [gpu[0].block_hashes[:2], gpu[0].block_hashes[2:]]
    assert cpu[1].parent_block_hash == gpu[0].block_hashes[1]


class BadEventAdapter(ReferenceAdapter):
    """Publishes one bad event in its third step."""

    name = "bad-event"
    bad: dict = {}

    def observe(self, result) -> StepObservation:
        observation = super().observe(result)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps != 3:
            return observation
        return observation.model_copy(update={"kv_events": (*observation.kv_events, self.bad)})


@pytest.mark.parametrize("bad, clause, text", [
    ({"type": "BlockEvicted"}, "EVT-FORMAT-1", "unknown event type"),
    (stored(block_hashes=["ab" * 4]), "EVT-FORMAT-1", "block_hashes.0"),
    ({"type": "BlockRemoved", "block_hashes": ["ef" * 16], "medium": "CPU"}, "EVT-ORDER-1", "not announced"),
    (stored(), "EVT-HASH-1", "is no request's block hash"),
])
def test_malformed_events_get_a_verdict_naming_the_event(bad, clause, text):
    """EVT-FORMAT-1, EVT-ORDER-1, EVT-HASH-1: a bad event in a run is a verdict of its clause naming the step and
    the event, never a traceback from the kit."""
    adapter = type("Bad", (BadEventAdapter,), {"bad": bad})
    result = runner.run(adapter, "bad-event", "smoke")
    assert (result.passed, result.failed_clause) == (False, clause), result.message
    assert text in result.message and "step 3, event" in result.message, result.message
    assert result.adapter_traceback is None


class SilentAdapter(ReferenceAdapter):
    """The reference, publishing no events: its capabilities leave the events level out."""

    def capabilities(self):
        return super().capabilities().model_copy(update={"levels": ("connector", "offloading")})


def test_an_adapter_without_events_gets_not_applicable_never_passed():
    """Chapter kv-events: an adapter that reports no events gets "not applicable" for every EVT clause."""
    result = runner.run(SilentAdapter, "silent", "smoke")
    built = report.build(result, "0", SilentAdapter().capabilities())
    verdicts = {c.id: (c.verdict, c.not_applicable) for c in built.clauses if c.id.startswith("EVT-")}
    assert len(verdicts) >= 6
    assert all(verdict == "not applicable" and "no KV events" in why for verdict, why in verdicts.values())
    assert built.statistics.router_lookups == 0


def test_reference_passes_with_router_figures():
    """EVT-ROUTE-1: on the reference the router holds every block served, and the run counts its figures."""
    result = runner.run(ReferenceAdapter, "reference", "smoke")
    assert result.passed, result.message
    exercised = {clause for clause, count in result.coverage.items() if clause.startswith("EVT-") and count}
    assert len(exercised) >= 9, sorted(exercised)
    assert result.statistics.router_lookups and result.statistics.router_blocks_served
    assert result.statistics.router_blocks_predicted >= result.statistics.router_blocks_served
