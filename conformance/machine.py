"""The conformance state machine: drives an adapter and the reference side by side (chapter `conformance`).

Rules are named after the adapter operation they perform, so a shrunk failure reads as a call trace.
After every rule the observations of both are compared by the registered checks (`checks.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvconform.adapters.contract import Capabilities, EngineConfig, KVConnectorAdapter, RequestSpec, StepObservation
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterCaller, judging
from kvconform.conformance.checks import ClauseViolation, Context, checks_of
from kvconform.reference.request import RequestStatus

BASE_PROMPTS = tuple(tuple((seed * 5 + i * (seed + 2)) % 4 for i in range(32)) for seed in range(3))
"""Shared prompt prefixes: requests draw prefixes of these so that prefix and offload hits really happen."""

MAX_LIVE_REQUESTS = 5
DRAIN_STEP_LIMIT = 64


Scheduling = Literal["sync", "async", "both"]
"""Which scheduling modes a run draws: sync only, async only, or both."""


@dataclass
class Session:
    """What the examples of one run share: the options they run under, and the coverage and step count they add up."""

    adapter_factory: Callable[[], KVConnectorAdapter] = ReferenceAdapter
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT
    scheduling: Scheduling = "both"
    baseline: Baseline = field(default_factory=Baseline)
    on_example: Callable[[], None] | None = None
    coverage: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    adapter_seconds: float = 0.0
    reference_seconds: float = 0.0


def scheduling_modes(capabilities: Capabilities, scheduling: Scheduling) -> list[bool]:
    """Return the `async_scheduling` values a run may draw: those asked for that the adapter supports (CONF-CAP-1)."""
    wanted = {"sync": [False], "async": [True], "both": [False, True]}[scheduling]
    return [mode for mode in wanted if capabilities.async_scheduling or not mode]


@st.composite
def engine_configs(draw: st.DrawFn, capabilities: Capabilities, scheduling: Scheduling = "both") -> EngineConfig:
    """Draw an engine configuration within what the adapter claims (CONF-CAP-1)."""
    return EngineConfig(
        block_size=4,
        num_gpu_blocks=draw(st.sampled_from((12, 16, 64)), label="num_gpu_blocks"),
        block_size_factor=draw(st.sampled_from(sorted(capabilities.block_size_factors)), label="factor"),
        num_offload_blocks=draw(st.integers(1, 6), label="num_offload_blocks"),
        eviction_policy=draw(st.sampled_from(sorted(capabilities.eviction_policies)), label="policy"),
        async_scheduling=draw(st.sampled_from(scheduling_modes(capabilities, scheduling)), label="async"),
        max_num_batched_tokens=draw(st.sampled_from((16, 256)), label="token_budget"),
    )


@st.composite
def prompts(draw: st.DrawFn, earlier: tuple[tuple[int, ...], ...] = ()) -> tuple[int, ...]:
    """Draw an earlier prompt again, or a prefix of a shared base prompt with an optional private suffix."""
    if earlier and draw(st.booleans(), label="repeat"):
        prefix = draw(st.sampled_from(earlier), label="earlier_prompt")
    else:
        base = draw(st.sampled_from(BASE_PROMPTS), label="base")
        prefix = base[: draw(st.sampled_from((12, 24)) | st.integers(1, len(base)), label="prefix_length")]
    suffix = draw(st.lists(st.integers(0, 3), max_size=12), label="suffix")
    return prefix[:40] + tuple(suffix)[: 40 - len(prefix)]


class ConnectorStateMachine(RuleBasedStateMachine):
    """Compares an adapter under test with the reference; subclass via `machine_for`."""

    session = Session()

    def __init__(self) -> None:
        super().__init__()
        self.caller = AdapterCaller(self.session.call_timeout)
        self.oracle: ReferenceAdapter | None = None
        self.ctx: Context | None = None
        self.capabilities = Capabilities()
        self.next_id = 0

    # --- helpers ---------------------------------------------------------------------------

    def call(self, operation: str, *args: Any) -> Any:
        """Return the adapter's validated answer; a raise, a hang or a bad value fails its clause (`calls.py`)."""
        return self.caller(operation, *args)

    def expect(self, operation: str, *args: Any) -> Any:
        """Return the reference's answer to `operation(*args)`, timing it apart from the harness."""
        started = time.perf_counter()
        try:
            return getattr(self.oracle, operation)(*args)
        finally:
            self.session.reference_seconds += time.perf_counter() - started

    def unfinished(self) -> list[str]:
        return sorted(r for r, req in self.oracle.engine.requests.items() if not req.is_finished)

    def running(self) -> list[str]:
        return sorted(r for r, req in self.oracle.engine.requests.items() if req.status is RequestStatus.RUNNING)

    def judge(self, call: str, kind: str, *args: Any) -> None:
        """Run the checks of `kind` on the answer of `call`; known failures are recorded, not raised (CONF-RUN-2)."""
        for each in checks_of(kind):
            try:
                with judging(call):
                    each.function(self.ctx, *args)
            except ClauseViolation as violation:
                if not self.session.baseline.tolerates(violation):
                    raise

    def compare_step(self, expected: StepObservation, actual: StepObservation) -> None:
        self.session.steps += 1
        self.judge("adapter.step()", "step", expected, actual)
        store = self.expect("store_contents")
        self.judge("adapter.store_contents()", "store", store, self.call("store_contents"))
        self.ctx.previous_store = store
        if self.capabilities.reads_kv:
            for request_id in self.running():
                self.judge(f"adapter.computed_kv({request_id!r})", "data", request_id,
                           self.call("computed_kv", request_id))

    # --- rules -------------------------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        if self.session.on_example is not None:
            self.session.on_example()
        self.caller.build(self.session.adapter_factory)
        self.capabilities = self.call("capabilities")
        config = data.draw(engine_configs(self.capabilities, self.session.scheduling), label="config")
        note(f"state.start({config!r})")
        self.oracle = ReferenceAdapter()
        self.expect("start", config)
        self.call("start", config)
        self.ctx = Context(config, {}, self.oracle.engine, exercised=self.session.coverage)

    @precondition(lambda self: len(self.unfinished()) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        spec = RequestSpec(
            request_id=f"r{self.next_id}",
            prompt=data.draw(prompts(tuple(s.prompt for s in self.ctx.requests.values())), label="prompt"),
            max_tokens=data.draw(st.integers(1, 3), label="max_tokens"),
            skip_reading_prefix_cache=data.draw(st.booleans(), label="skip_reading_prefix_cache"),
            cache_salt=data.draw(st.sampled_from((None, None, "tenant-a", "tenant-b")), label="cache_salt"),
            lora_name=data.draw(st.sampled_from((None, None, "lora-x")), label="lora_name"),
        )
        note(f"state.add_request({spec!r})")
        self.next_id += 1
        self.ctx.requests[spec.request_id] = spec
        self.expect("add_request", spec)
        self.call("add_request", spec)

    @rule(transfers_done=st.booleans())
    def step(self, transfers_done: bool) -> None:
        """Step both engines; with `transfers_done`, every in-flight transfer succeeds first."""
        if transfers_done:
            self.complete_transfers(False, False)
        note("state.step()")
        expected = self.expect("step")
        self.compare_step(expected, self.call("step"))

    @rule(fail_loads=st.booleans(), fail_stores=st.booleans())
    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        fail_loads &= self.capabilities.transfer_failures
        fail_stores &= self.capabilities.transfer_failures
        note(f"state.complete_transfers(fail_loads={fail_loads}, fail_stores={fail_stores})")
        self.expect("complete_transfers", fail_loads, fail_stores)
        self.call("complete_transfers", fail_loads, fail_stores)

    @precondition(lambda self: self.capabilities.abort and self.unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.unfinished()), label="request_id")
        note(f"state.abort({request_id!r})")
        self.expect("abort", request_id)
        self.call("abort", request_id)

    @precondition(lambda self: self.capabilities.preemption and self.running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.running()), label="request_id")
        note(f"state.preempt({request_id!r})")
        self.expect("preempt", request_id)
        self.call("preempt", request_id)

    @rule(reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_connector: bool) -> None:
        reset_connector &= self.capabilities.reset_connector
        note(f"state.reset_prefix_cache(reset_connector={reset_connector})")
        expected = self.expect("reset_prefix_cache", reset_connector)
        actual = self.call("reset_prefix_cache", reset_connector)
        self.ctx.exercise("PFX-RESET-1")
        if expected != actual:
            raise ClauseViolation("PFX-RESET-1", f"reset_prefix_cache returned {actual!r}, reference {expected!r}")

    def teardown(self) -> None:
        if self.caller.adapter is not None and not self.caller.hung:
            self.call("close")
        self.session.adapter_seconds += self.caller.seconds

    @rule()
    def drain(self) -> None:
        """Complete every transfer and step until the reference is idle, then check for leaks and liveness."""
        note("state.drain()")
        steps = 0
        while steps < DRAIN_STEP_LIMIT and (self.unfinished() or self.oracle.engine.in_flight_job_count()
                                            or self.oracle.engine.in_flight is not None):
            self.expect("complete_transfers", False, False)
            self.call("complete_transfers", False, False)
            self.compare_step(self.expect("step"), self.call("step"))
            steps += 1
        for each in checks_of("drain"):
            each.function(self.ctx, self.expect("resource_usage"), steps)
        self.judge("adapter.resource_usage()", "drain", self.call("resource_usage"), steps)


def machine_for(session: Session) -> type[ConnectorStateMachine]:
    """Return a state-machine class that runs the examples of `session`."""
    name = getattr(session.adapter_factory, "__name__", "Adapter")
    return type(f"ConnectorStateMachine_{name}", (ConnectorStateMachine,), {"session": session})
