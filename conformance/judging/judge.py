"""The seam every level's judge is built on (chapter `conformance`): the violation a check raises, the registry of
checks, the `Judge` protocol an execution drives, and the `Run` protocol, what a judge may ask of the execution it
judges.

A level is one module of this folder: a judge class and the checks it runs, registered here by `check` under kinds of
its own; `levels.JUDGES` names the judge of each level. A check raises `ClauseViolation`; checks of one kind run in
the order they are registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    TransferOutcome,
)
from kvconform.reference.engine import Engine


class ClauseViolation(AssertionError):
    """The adapter under test broke a clause; `clause` is its ID."""

    def __init__(self, clause: str, message: str, adapter_traceback: str | None = None) -> None:
        super().__init__(f"[{clause}] {message}")
        self.clause = clause
        self.detail = message
        self.adapter_traceback = adapter_traceback
        self.program: list | None = None
        """The program (`execution.Call`s) of the execution it ended: the counterexample; set as it leaves it."""
        self.calls: list[str] = []
        """The adapter calls that execution made, which stand for the program when it failed before `start`."""

    @property
    def executed_program(self) -> list:
        """Return the program of the execution the violation ended (`program`), which every execution sets."""
        if self.program is None:
            raise RuntimeError(f"[{self.clause}] was raised outside an execution: it carries no program")
        return self.program


Kind = str
"""What a check judges, named by its level's module: a step, the store, the bytes, the drained engine, … (`check`)."""


@dataclass
class Check:
    name: str
    clauses: tuple[str, ...]
    kind: Kind
    function: Callable[..., None]
    doc: str


CHECKS: dict[str, Check] = {}
"""Every registered check by name; complete once `levels` is imported (each level's module registers its own)."""


def check(*clauses: str, kind: Kind) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a check of `kind` for `clauses`; its first docstring line says what it verifies. A check is known by
    its name: a second module's check of the same name would replace the first unseen, so it is refused."""

    def register(function: Callable[..., None]) -> Callable[..., None]:
        known = CHECKS.get(function.__name__)
        if known is not None and known.function.__module__ != function.__module__:
            raise ValueError(f"two checks are named {function.__name__}: in {known.function.__module__} and in "
                             f"{function.__module__}")
        doc = (function.__doc__ or "").strip().splitlines()[0]
        CHECKS[function.__name__] = Check(function.__name__, clauses, kind, function, doc)
        checks_of.cache_clear()
        return function

    return register


@functools.cache
def checks_of(kind: Kind) -> tuple[Check, ...]:
    """Return the checks of `kind` in the order registered; looked up once per kind, not once per judged answer."""
    found = tuple(c for c in CHECKS.values() if c.kind == kind)
    if not found:
        raise KeyError(f"no check is registered for the kind {kind!r}: a judge names a kind of its own level")
    return found


class Run(Protocol):
    """What a judge may ask of the execution it judges (`execution.Execution` is one)."""

    @property
    def capabilities(self) -> Capabilities:
        """What the adapter claimed to support (CONF-CAP-1)."""

    @property
    def requests(self) -> Mapping[str, RequestSpec]:
        """The requests added so far, by id."""

    @property
    def coverage(self) -> dict[str, int]:
        """Where the clauses exercised are counted."""

    @property
    def step_called(self) -> float:
        """When the latest step was called (`time.monotonic`): what the adapter did in it began no earlier."""

    def judge(self, call: str, kind: Kind, subject: object, *args: Any) -> None:
        """Run the checks of `kind` on the answer of `call`; a known failure ends the example (CONF-RUN-2)."""

    def call(self, operation: str, *args: Any) -> Any:
        """Return the adapter's validated answer to one more call, made for the judge (a store's contents, bytes)."""

    def now(self) -> float:
        """Return the run's clock (`time.monotonic`, or a checked trace's recorded reading)."""

    def reference_engine(self, config: EngineConfig) -> Engine:
        """Return a fresh reference engine, the spec's model, for `config`; its time is the reference's."""

    def timed_reference(self, seconds: float) -> None:
        """Count `seconds` as the reference engine's (`RunStatistics.reference_seconds`)."""

    def known_failures(self) -> Collection[str]:
        """Return the clauses the run lists as known failures (CONF-RUN-2)."""

    def tolerates(self, violation: ClauseViolation) -> bool:
        """Return True if the run lists `violation` as a known failure (CONF-RUN-2)."""

    def followed_deviation(self) -> None:
        """Note that the reference followed a known deviation of the adapter in this example (CONF-RUN-2)."""

    def finding(self, clause: str, detail: str) -> None:
        """Report a fault the engine masked as a finding of `clause`, not a failure; the first one per clause stays."""

    def tally(self, figure: str, count: int) -> None:
        """Add `count` to one of the run's figures (`RunStatistics`: the router model's, chapter `kv-events`)."""


class EngineState(Protocol):
    """Where the engine's requests are, as a judge follows them: for the state machine's preconditions and the drain."""

    def unfinished(self) -> list[str]: ...
    def loading(self) -> list[str]: ...
    def running(self) -> list[str]: ...
    def storing(self) -> list[str]: ...
    def stores_in_flight(self) -> bool: ...
    def transfers_pending(self) -> bool: ...
    def resident(self) -> list[str]: ...
    def busy(self) -> bool: ...

    def idle(self, usage: ResourceUsage) -> bool:
        """Return True once an engine that is not `busy` needs no more steps, given the adapter's resource usage."""


class Judge(EngineState, Protocol):
    """One spec level's judge of an execution: told each operation before the adapter runs it, and each answer the
    adapter gave, it judges the answers by the checks of its level (`check`). Built at `start` from the run and the
    engine's config (`levels.JUDGES`)."""

    def add_request(self, spec: RequestSpec) -> None: ...
    def prefill(self, spec: RequestSpec) -> None: ...
    def decode(self, spec: RequestSpec, params: dict[str, Any]) -> None: ...
    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def preempt(self, request_id: str) -> None: ...
    def step_observed(self, observation: StepObservation, completed_in_step: TransferOutcome | None) -> None: ...
    def resident_kv(self, request_id: str, kv: torch.Tensor) -> None: ...
    def reset_answered(self, reset_connector: bool, answer: bool) -> None: ...
    def drained(self, usage: ResourceUsage, waited: str) -> None: ...
