"""Mutant adapters: the reference with one real vLLM bug put back (spec chapter `conformance`).

They are data for the kit's own tests and for `kvconform mutants`, deliberately not registered as
adapters. Each names the vLLM issue or PR whose bug it reintroduces and the clause the kit must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.reference.connector import OffloadConnectorScheduler
from kvconform.reference.engine import Engine
from kvconform.reference.offload_manager import OffloadManager


def mutant(engine_base: type[Engine] = Engine, **parts: type) -> type[ReferenceAdapter]:
    """Return a reference adapter whose engine uses the given replacement parts."""
    engine = type("MutantEngine", (engine_base,), parts)
    return type("MutantAdapter", (ReferenceAdapter,), {"engine_class": engine})


class SkipFlagIgnoredConnector(OffloadConnectorScheduler):
    """vLLM #44585 (fixed by PR #44592): skip_reading_prefix_cache ignored; the prefix is looked up and loaded."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        state = self.states[request.request_id]
        if state.transfer_jobs:
            return None, False
        state.num_local_tokens = num_computed_tokens
        hits = self._lookup(state)
        self.manager.touch(self.offload_keys(request))
        return hits, bool(hits)


class SkipReturnsEarlyConnector(OffloadConnectorScheduler):
    """PR #44592's rejected first draft: return (0, False) before tracking, so nothing is ever stored."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.skip_reading_prefix_cache:
            self.states.pop(request.request_id, None)
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class AsyncFlagOnZeroConnector(OffloadConnectorScheduler):
    """Answers load_async=True together with 0 tokens (base.py: the flag MUST be False when the count is 0)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hits, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return hits, hits is not None


class LookupPastMissConnector(OffloadConnectorScheduler):
    """The lookup does not stop at the first miss: it probes every remaining block."""

    def _lookup(self, state):
        hits = super()._lookup(state)
        request = state.request
        looked_up = self.recorder.lookups.get(request.request_id, [])
        for index in range(looked_up[-1] + 1 if looked_up else 0, len(self.offload_keys(request))):
            looked_up.append(index)
            self.manager.lookup(self.offload_keys(request)[index])
        return hits


class EvictsKeptKeysManager(OffloadManager):
    """vLLM #35846: prepare_store evicted keys it had been asked to keep (the protected set is ignored)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        evict = self.policy.evict
        self.policy.evict = lambda count, protected: evict(count, set())


class LoadCoversLastTokenEngine(Engine):
    """A full-prompt load is taken as computing every token: the last token is never recomputed."""

    def _finish_load(self, request, success):
        num_computed = request.num_computed_tokens
        super()._finish_load(request, success)
        if success:
            request.num_computed_tokens = num_computed


@dataclass(frozen=True)
class Mutant:
    """One catalogue row: the broken adapter, the vLLM reference of the bug, the clause it must fail."""

    adapter: type[ReferenceAdapter]
    vllm_ref: str
    clause: str


MUTANTS = {
    "skip-flag-ignored": Mutant(mutant(connector_class=SkipFlagIgnoredConnector), "#44585 / PR #44592", "OFF-READ-1"),
    "skip-returns-early": Mutant(mutant(connector_class=SkipReturnsEarlyConnector), "PR #44592 (first draft)", "OFF-READ-3"),
    "async-flag-on-zero": Mutant(mutant(connector_class=AsyncFlagOnZeroConnector), "base.py contract", "CONN-MATCH-2"),
    "load-covers-last-token": Mutant(mutant(LoadCoversLastTokenEngine), "kv_cache_manager.py contract", "PFX-HIT-3"),
    "lookup-past-miss": Mutant(mutant(connector_class=LookupPastMissConnector), "offloading scheduler contract", "OFF-LOOKUP-2"),
    "evicts-kept-keys": Mutant(mutant(manager_class=EvictsKeptKeysManager), "#35846", "OFF-MGR-7"),
}
"""Mutant name → catalogue row."""
