"""The exercise table: how often a run drew each situation whose window is short, per scheduling mode (CONF-CAP-1).

A situation is a call made while the engine is in a given state: a step while a load is in flight (a run that never
draws one never saw an external hit served, and every clause about loads held vacuously), an abort while the
request's load is in flight, a failed store while stores are in flight, a prefix-cache reset while loads are in
flight. Each is supported by the
adapters whose capabilities allow its call; a situation an adapter supports that a run never draws in a mode it
runs is a gap in the kit's strategies, not in the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvconform.common.values import Capabilities, TransferOutcome
from kvconform.conformance.judging.judge import EngineState
from kvconform.conformance.operations import Call

Mode = Literal["sync", "async"]


@dataclass(frozen=True)
class Situation:
    """A call in a state of the engine, and the adapters that support it."""

    name: str
    happens: Callable[[Call, EngineState], bool]
    """Whether `call`, made in this state, is the situation."""
    supported: Callable[[Capabilities], bool]


def _arg(call: Call, index: int) -> object:
    return call.args[index] if len(call.args) > index else None


def _fails(call: Call, transfers: str) -> bool:
    """Return whether `call` fails the `transfers` ("loads" or "stores") in flight: before a step, or inside it."""
    if call.operation == "complete_transfers":
        return bool(call.args[0 if transfers == "loads" else 1])
    outcome = _arg(call, 0) if call.operation == "step" else None
    return isinstance(outcome, TransferOutcome) and getattr(outcome, f"fail_{transfers}")


SITUATIONS = (
    Situation("step with a load in flight",
              lambda call, state: call.operation == "step" and bool(state.loading()),
              lambda capabilities: True),
    Situation("abort during a load",
              lambda call, state: call.operation == "abort" and call.args[0] in state.loading(),
              lambda capabilities: capabilities.abort),
    Situation("failed load",
              lambda call, state: _fails(call, "loads") and bool(state.loading()),
              lambda capabilities: capabilities.transfer_failures),
    Situation("failed store",
              lambda call, state: _fails(call, "stores") and state.stores_in_flight(),
              lambda capabilities: capabilities.transfer_failures and "offloading" in capabilities.levels),
    Situation("transfers completed inside a step",
              lambda call, state: call.operation == "step" and _arg(call, 0) is not None and state.transfers_pending(),
              lambda capabilities: capabilities.complete_in_step),
    Situation("preemption with stores in flight",
              lambda call, state: call.operation == "preempt" and call.args[0] in state.storing(),
              lambda capabilities: capabilities.preemption and "offloading" in capabilities.levels),
    Situation("prefix-cache reset with loads in flight",
              lambda call, state: call.operation == "reset_prefix_cache" and bool(state.loading()),
              lambda capabilities: True),
    Situation("connector reset with transfers in flight",
              lambda call, state: call.operation == "reset_prefix_cache" and bool(call.args[0])
              and state.transfers_pending(),
              lambda capabilities: capabilities.reset_connector),
)
"""The situations the exercise table counts (issue 25, item 8)."""

Table = dict[str, dict[str, int]]
"""Scheduling mode -> situation -> times drawn."""


def note(table: Table, mode: Mode, call: Call, state: EngineState) -> None:
    """Count the situations `call`, about to run in `state`, is."""
    counts = table.setdefault(mode, dict.fromkeys((situation.name for situation in SITUATIONS), 0))
    for situation in SITUATIONS:
        if situation.happens(call, state):
            counts[situation.name] += 1


def added(tables: Iterable[Table]) -> Table:
    """Return the table of a run split across workers: its parts' counts added up."""
    total: Table = {}
    for table in tables:
        for mode, counts in table.items():
            into = total.setdefault(mode, dict.fromkeys(counts, 0))
            for name, count in counts.items():
                into[name] = into.get(name, 0) + count
    return total


def never_drawn(table: Table, capabilities: Capabilities) -> list[str]:
    """Return `mode: situation` for every situation the adapter supports that a mode of the run never drew."""
    return [f"{mode}: {situation.name}" for mode, counts in sorted(table.items()) for situation in SITUATIONS
            if situation.supported(capabilities) and not counts.get(situation.name)]
