"""What one engine step did, as plain data: the reference's side of the observations."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconform.reference.offload_manager import OffloadKey


@dataclass
class StepRecorder:
    """Collects one step's connector activity; `take()` hands it over and starts afresh."""

    lookups: dict[str, list[int]] = field(default_factory=dict)
    answers: list[tuple[str, int, int | None, bool]] = field(default_factory=list)
    loads: list[tuple[str, list[int], int, int]] = field(default_factory=list)
    store_offers: list[tuple[str, list[int]]] = field(default_factory=list)
    offer_evictions: list[list[OffloadKey]] = field(default_factory=list)
    stores: list[tuple[str, list[int]]] = field(default_factory=list)
    evicted: list[OffloadKey] = field(default_factory=list)
    completed_loads: list[tuple[str, list[int], int, int]] = field(default_factory=list)
    completed_stores: list[tuple[str, list[int]]] = field(default_factory=list)
    flushed_stores: list[tuple[str, list[int]]] = field(default_factory=list)
    touches: list[tuple[str, int]] = field(default_factory=list)
    promoted: dict[str, int] = field(default_factory=dict)
    """Waiting requests whose finished load the step took up, in order → the answers given before (LIFE-LOAD-1)."""
    adopted: list[tuple[str, str]] = field(default_factory=list)
    """Known deviations of the followed engine taken in place of the reference's own choice: (clause, what)."""

    def take(self) -> StepRecorder:
        taken = StepRecorder(**vars(self))
        vars(self).update(vars(StepRecorder()))
        return taken
