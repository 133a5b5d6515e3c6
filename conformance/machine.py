"""The conformance state machine: drives an adapter and the reference side by side (chapter `conformance`).

Rules are named after the adapter operation they perform, so a shrunk failure reads as a call trace.
After every engine step the observations of both are compared by the registered checks (`checks.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvconform.adapters.contract import Capabilities, EngineConfig, KVConnectorAdapter, RequestSpec, StepObservation
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterCaller
from kvconform.conformance.checks import ClauseViolation, Context, checks_of

BASE_PROMPTS = tuple(tuple((seed * 5 + i * (seed + 2)) % 4 for i in range(32)) for seed in range(3))
"""Shared prompt prefixes: requests draw prefixes of these so that prefix and offload hits really happen."""

MAX_LIVE_REQUESTS = 5
MAX_PROMPT_TOKENS = 40
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
    last_caller: AdapterCaller | None = None


def scheduling_modes(capabilities: Capabilities, scheduling: Scheduling) -> list[bool]:
    """Return the `async_scheduling` values a run may draw: those asked for that the adapter supports (CONF-CAP-1)."""
    wanted = {"sync": [False], "async": [True], "both": [False, True]}[scheduling]
    return [mode for mode in wanted if capabilities.async_scheduling or not mode]


@st.composite
def engine_configs(draw: st.DrawFn, capabilities: Capabilities, scheduling: Scheduling = "both") -> EngineConfig:
    """Draw an engine configuration within what the adapter claims (CONF-CAP-1)."""
    return EngineConfig(
        block_size=4,
        num_gpu_blocks=draw(st.sampled_from((12, 16, 24, 64)), label="num_gpu_blocks"),
        block_size_factor=draw(st.sampled_from(sorted(capabilities.block_size_factors)), label="factor"),
        num_offload_blocks=draw(st.integers(1, 12), label="num_offload_blocks"),
        eviction_policy=draw(st.sampled_from(sorted(capabilities.eviction_policies)), label="policy"),
        async_scheduling=draw(st.sampled_from(scheduling_modes(capabilities, scheduling)), label="async"),
        max_num_batched_tokens=draw(st.sampled_from((16, 256)), label="token_budget"),
    )


SOMETIMES = st.integers(0, 3).map(lambda n: n == 3)
"""True about one time in four; shrinks to False."""

STEP_COUNTS = st.integers(1, 16)
"""Engine steps one `step` rule runs: several per rule keep the harness's cost per step low."""

TENANTS = st.sampled_from(
    ((None, None), (None, None), ("tenant-a", None), ("tenant-b", None), (None, "lora-x"), ("tenant-a", "lora-x")))
"""(cache_salt, lora_name) pairs; requests of different tenants must never share cached KV (PFX-HASH-2, OFF-KEY-2)."""

BASES = st.sampled_from(BASE_PROMPTS)
PREFIX_LENGTHS = st.sampled_from((4, 8, 12, 16, 24, 32)) | st.integers(1, len(BASE_PROMPTS[0]))
"""Often block-aligned for every block_size_factor, so that whole offloaded blocks repeat."""

SUFFIX_LENGTHS = st.integers(1, 8)
MAX_TOKENS = st.integers(1, 4)


@st.composite
def request_specs(draw: st.DrawFn, request_id: str, earlier: tuple[RequestSpec, ...] = ()) -> RequestSpec:
    """Draw a request that shares prefixes with earlier ones, so that prefix-cache and store hits really happen.

    Most of the time an earlier request's prompt comes again, whole or extended, usually for the same tenant;
    otherwise a prefix of a shared base prompt, often block-aligned, whole or with a private suffix. Strategies
    are built once at import: building one per draw costs more than the engine step it feeds.
    """
    if earlier and not draw(SOMETIMES, label="fresh"):
        before = earlier[draw(st.integers(0, len(earlier) - 1), label="earlier_request")]
        prefix = before.prompt
        tenant = draw(TENANTS, label="tenant") if draw(SOMETIMES, label="other_tenant") else (
            before.cache_salt, before.lora_name)
    else:
        prefix = draw(BASES, label="base")[: draw(PREFIX_LENGTHS, label="prefix_length")]
        tenant = draw(TENANTS, label="tenant")
    suffix = _suffix(draw) if draw(st.booleans(), label="extend") else ()
    return RequestSpec(
        request_id=request_id,
        prompt=(prefix + suffix)[:MAX_PROMPT_TOKENS],
        max_tokens=draw(MAX_TOKENS, label="max_tokens"),
        skip_reading_prefix_cache=draw(SOMETIMES, label="skip_reading_prefix_cache"),
        cache_salt=tenant[0],
        lora_name=tenant[1],
    )


def _suffix(draw: st.DrawFn) -> tuple[int, ...]:
    """Draw up to 8 private tokens as the base-4 digits of one number: two draws instead of one per token."""
    length = draw(SUFFIX_LENGTHS, label="suffix_length")
    digits = draw(st.integers(0, 4**length - 1), label="suffix_tokens")
    return tuple((digits >> (2 * position)) & 3 for position in range(length))


class ConnectorStateMachine(RuleBasedStateMachine):
    """Compares an adapter under test with the reference; subclass via `machine_for`.

    Rules are named after the adapter operation they perform. The counterexample of a failure is the list of
    state-changing adapter calls of the final, shrunk example (`AdapterCaller.program`), replayable as is.
    """

    session = Session()

    def __init__(self) -> None:
        super().__init__()
        self.caller = AdapterCaller(self.session.call_timeout)
        self.session.last_caller = self.caller
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
        engine = self.oracle.engine
        return sorted(request.request_id for request in (*engine.waiting, *engine.running))

    def running(self) -> list[str]:
        return sorted(request.request_id for request in self.oracle.engine.running)

    def judge(self, call: str, kind: str, *args: Any) -> None:
        """Run the checks of `kind` on the answer of `call`; known failures are recorded, not raised (CONF-RUN-2).

        A failure names the call whose answer it judged (CONF-CALL-1).
        """
        for each in checks_of(kind):
            try:
                each.function(self.ctx, *args)
            except ClauseViolation as violation:
                violation.detail = f"{call}: {violation.detail}"
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
        self.oracle = ReferenceAdapter()
        self.expect("start", config)
        self.call("start", config)
        self.ctx = Context(config, {}, self.oracle.engine, exercised=self.session.coverage)

    @precondition(lambda self: len(self.oracle.engine.waiting) + len(self.oracle.engine.running) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        spec = data.draw(request_specs(f"r{self.next_id}", tuple(self.ctx.requests.values())), label="request")
        self.next_id += 1
        self.ctx.requests[spec.request_id] = spec
        self.expect("add_request", spec)
        self.call("add_request", spec)

    @rule(count=STEP_COUNTS, transfers_done=st.booleans())
    def step(self, count: int, transfers_done: bool) -> None:
        """Step both engines `count` times; with `transfers_done`, every in-flight transfer succeeds before each step."""
        for _ in range(count):
            if transfers_done:
                self.complete_transfers(False, False)
            self.compare_step(self.expect("step"), self.call("step"))

    @rule(fail_loads=SOMETIMES, fail_stores=SOMETIMES)
    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        fail_loads &= self.capabilities.transfer_failures
        fail_stores &= self.capabilities.transfer_failures
        self.expect("complete_transfers", fail_loads, fail_stores)
        self.call("complete_transfers", fail_loads, fail_stores)

    @precondition(lambda self: self.capabilities.abort and (self.oracle.engine.waiting or self.oracle.engine.running))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.unfinished()), label="request_id")
        self.expect("abort", request_id)
        self.call("abort", request_id)

    @precondition(lambda self: self.capabilities.preemption and self.oracle.engine.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.running()), label="request_id")
        self.expect("preempt", request_id)
        self.call("preempt", request_id)

    @rule(reset_connector=SOMETIMES)
    def reset_prefix_cache(self, reset_connector: bool) -> None:
        reset_connector &= self.capabilities.reset_connector
        expected = self.expect("reset_prefix_cache", reset_connector)
        actual = self.call("reset_prefix_cache", reset_connector)
        self.ctx.exercise("PFX-RESET-1")
        if expected != actual:
            raise ClauseViolation("PFX-RESET-1", f"reset_prefix_cache returned {actual!r}, reference {expected!r}")

    @rule(then_reset=st.booleans())
    def drain(self, then_reset: bool) -> None:
        """Complete every transfer and step until the reference is idle, then check for leaks and liveness.

        With `then_reset` the idle engine's prefix cache is reset: only the store still holds the prompts seen.
        """
        steps = 0
        while steps < DRAIN_STEP_LIMIT and (self.unfinished() or self.oracle.engine.in_flight_job_count()
                                            or self.oracle.engine.in_flight is not None):
            self.complete_transfers(False, False)
            self.compare_step(self.expect("step"), self.call("step"))
            steps += 1
        for each in checks_of("drain"):
            each.function(self.ctx, self.expect("resource_usage"), steps)
        self.judge("adapter.resource_usage()", "drain", self.call("resource_usage"), steps)
        if then_reset:
            self.reset_prefix_cache(reset_connector=False)

    def teardown(self) -> None:
        if self.caller.adapter is not None and not self.caller.hung:
            self.call("close")
        self.session.adapter_seconds += self.caller.seconds


def machine_for(session: Session) -> type[ConnectorStateMachine]:
    """Return a state-machine class that runs the examples of `session`."""
    name = getattr(session.adapter_factory, "__name__", "Adapter")
    return type(f"ConnectorStateMachine_{name}", (ConnectorStateMachine,), {"session": session})
