"""The conformance state machine: draws programs of engine operations (chapter `conformance`).

Rules are named after the adapter operation they perform. Each rule draws its arguments and hands the
calls to an `Execution`, which runs them on the adapter and has the judge of each level it is judged at judge every
answer; the calls run so far are the example's program, which the shrinker edits when it fails.
"""

from __future__ import annotations

import contextlib
import time

import hypothesis.strategies as st
from hypothesis import reject
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvconform.common.values import VARIANTS, Capabilities, EngineConfig, RequestSpec, TransferOutcome
from kvconform.conformance.execution import DRAIN_STEP_LIMIT, Diverged, Execution, Scheduling, Session
from kvconform.conformance.operations import Call

BASE_PROMPTS = tuple(tuple((seed * 5 + i * (seed + 2)) % 4 for i in range(48)) for seed in range(3))
"""Shared prompt prefixes: requests draw prefixes of these so that prefix and offload hits really happen."""

MAX_LIVE_REQUESTS = 5
MAX_PROMPT_TOKENS = 56


def scheduling_modes(capabilities: Capabilities, scheduling: Scheduling) -> list[bool]:
    """Return the `async_scheduling` values a run may draw: those asked for that the adapter supports (CONF-CAP-1)."""
    wanted = {"sync": [False], "async": [True], "both": [False, True]}[scheduling]
    return [mode for mode in wanted if capabilities.async_scheduling or not mode]


@st.composite
def engine_configs(draw: st.DrawFn, capabilities: Capabilities, scheduling: Scheduling = "both",
                   tensor_parallel_size: int | None = None) -> EngineConfig:
    """Draw an engine configuration within what the adapter claims (CONF-CAP-1), at the run's tensor-parallel size
    or one of those the adapter runs (KVC-DATA-1, PD-TP-1)."""
    return EngineConfig(
        block_size=4,
        num_gpu_blocks=draw(GPU_POOLS, label="num_gpu_blocks"),
        block_size_factor=draw(st.sampled_from(sorted(capabilities.block_size_factors)), label="factor"),
        num_offload_blocks=draw(STORE_SIZES, label="num_offload_blocks"),
        eviction_policy=draw(st.sampled_from(sorted(capabilities.eviction_policies)), label="policy"),
        async_scheduling=draw(st.sampled_from(scheduling_modes(capabilities, scheduling)), label="async"),
        max_num_batched_tokens=draw(st.sampled_from((16, 256)), label="token_budget"),
        **{variant: draw(st.sampled_from(sorted(getattr(capabilities, variant))), label=variant)
           for variant in VARIANTS},
        tensor_parallel_size=tensor_parallel_size or draw(st.sampled_from(sorted(capabilities.tensor_parallel_sizes)),
                                                          label="tensor_parallel_size"),
    )


GPU_POOLS = st.sampled_from((16, 16, 20, 32, 64))
"""GPU blocks, the null block included. 16 holds one request of MAX_PROMPT_TOKENS plus its outputs, so pools are
mostly tight: the prefix cache forgets, requests preempt each other and freed blocks are reused soon."""

STORE_SIZES = st.integers(1, 6) | st.integers(16, 32)
"""Offloaded blocks the store holds: small stores evict all the time; large ones, as CPU memory is, outlive the
GPU prefix cache, so a request finds its prefix's head on the GPU and its tail in the store."""

SOMETIMES = st.integers(0, 3).map(lambda n: n == 3)
"""True about one time in four; shrinks to False."""

STEP_COUNTS = st.integers(1, 8)
"""Engine steps one `step` rule runs: several per rule keep the harness's cost per step low."""

TENANTS = st.sampled_from(
    ((None, None), (None, None), ("tenant-a", None), ("tenant-b", None), (None, "lora-x"), ("tenant-a", "lora-x")))
"""(cache_salt, lora_name) pairs; requests of different tenants must never share cached KV (PFX-HASH-2, OFF-KEY-2)."""

BASES = st.sampled_from(BASE_PROMPTS)
PREFIX_LENGTHS = st.sampled_from((4, 8, 12, 16, 24, 32, 48)) | st.integers(1, len(BASE_PROMPTS[0]))
"""Often block-aligned for every block_size_factor, so that whole offloaded blocks repeat."""

SUFFIX_LENGTHS = st.integers(1, 8)
BURSTS = st.integers(1, 3)
MAX_TOKENS = st.integers(1, 4)


@st.composite
def new_requests(draw: st.DrawFn, request_id: str) -> RequestSpec:
    """Draw a request with a new prompt: a prefix of a shared base prompt, often block-aligned, maybe with a suffix.

    Strategies are built once at import: building one per draw costs more than the engine step it feeds.
    """
    prefix = draw(BASES, label="base")[: draw(PREFIX_LENGTHS, label="prefix_length")]
    return _request(draw, request_id, prefix, draw(TENANTS, label="tenant"))


@st.composite
def repeated_requests(draw: st.DrawFn, request_id: str, before: RequestSpec) -> RequestSpec:
    """Draw a request that repeats an earlier one's prompt, whole, cut or extended, mostly for the same tenant.

    Repeats are what make prefix-cache and store hits, loads from the middle of an offloaded block, and
    cross-tenant lookups happen.
    """
    prefix = before.prompt
    if draw(st.booleans(), label="cut"):
        prefix = prefix[: draw(st.integers(1, len(prefix)), label="cut_length")]
    tenant = draw(TENANTS, label="tenant") if draw(SOMETIMES, label="other_tenant") else (
        before.cache_salt, before.lora_name)
    return _request(draw, request_id, prefix, tenant)


def _request(draw: st.DrawFn, request_id: str, prefix: tuple[int, ...], tenant: tuple[str | None, str | None]
             ) -> RequestSpec:
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
    """Draws programs for the adapter of `session`; subclass via `machine_for`."""

    session: Session
    """The run this machine draws examples for; `machine_for` sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.run = Execution(self.session)
        self.added_since_drain = 0

    def apply(self, operation: str, *args) -> None:
        """Run one call on both engines; a known failure ends the example there (CONF-RUN-2)."""
        try:
            self.run.apply(Call(operation, args))
        except Diverged:
            reject()

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        self.session.statistics.examples += 1
        if self.session.on_example is not None:
            self.session.on_example()
        config = engine_configs(self.run.begin(), self.session.scheduling, self.session.tensor_parallel_size)
        self.apply("start", data.draw(config, label="config"))

    # Hypothesis must draw the same data whenever it replays an example. Where the harness completes transfers the
    # adapter is deterministic, and the rules may read its state: preconditions and the candidates a rule draws
    # from. A connector on its own clock is not (its threads decide when a load ends), so there the preconditions
    # read only what the harness itself did, and a rule draws an index it maps onto the candidates of the moment
    # when it runs, or does nothing when there are none. Its draws then never depend on the adapter's timing.

    @property
    def on_own_clock(self) -> bool:
        return not self.run.capabilities.harness_completes_transfers

    def live_requests(self) -> int:
        """Return the unfinished requests; on the connector's clock, those added since the last drain (an upper bound
        the harness knows without asking the adapter)."""
        return self.added_since_drain if self.on_own_clock else len(self.run.state.unfinished())

    def pick(self, data: st.DataObject, candidates: list[str]) -> str | None:
        """Draw one of `candidates` (sorted request ids); on the connector's clock, by an index that does not depend
        on how many there are, None when there are none."""
        if not self.on_own_clock:
            return data.draw(st.sampled_from(candidates), label="request_id")
        index = data.draw(st.integers(0, MAX_LIVE_REQUESTS - 1), label="request_index")
        return candidates[index % len(candidates)] if candidates else None

    def add(self, spec: RequestSpec) -> None:
        self.added_since_drain += 1
        self.apply("add_request", spec)

    def drain_engine(self) -> None:
        self.apply("drain")
        self.added_since_drain = 0

    @precondition(lambda self: self.live_requests() < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), count=BURSTS)
    def add_request(self, data: st.DataObject, count: int) -> None:
        """Add a burst of new requests: arriving together, three or more run at once, so that a preemption has a
        choice of victims (SCHED-PREEMPT-1)."""
        for _ in range(min(count, MAX_LIVE_REQUESTS - self.live_requests())):
            self.add(data.draw(new_requests(f"r{len(self.run.requests)}"), label="request"))

    @precondition(lambda self: self.run.requests and self.live_requests() < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), count=BURSTS)
    def repeat_request(self, data: st.DataObject, count: int) -> None:
        """Add a burst of requests repeating one earlier prompt, as users sharing a system prompt do.

        A rule of its own, so that half the requests are repeats. Within a burst one request may compute the
        head of the prompt that the next one hits locally, loading the rest from the middle of an offloaded
        block (XFER-LOAD-1).
        """
        earlier = list(self.run.requests.values())
        before = earlier[data.draw(st.integers(0, len(earlier) - 1), label="earlier_request")]
        for _ in range(min(count, MAX_LIVE_REQUESTS - self.live_requests())):
            request_id = f"r{len(self.run.requests)}"
            self.add(data.draw(repeated_requests(request_id, before), label="request"))

    @precondition(lambda self: self.run.requests)
    @rule(data=st.data(), count=BURSTS)
    def revisit(self, data: st.DataObject, count: int) -> None:
        """Drain, reset the prefix cache, then repeat an earlier prompt in a burst: now only the store remembers it.

        This is vLLM's own regression scenario for the seed rule (OFF-READ-1); and when one request of the burst
        computes the prompt's head, the next loads the rest from the middle of an offloaded block (XFER-LOAD-1).
        """
        self.drain_engine()
        self.apply("reset_prefix_cache", False)
        self.repeat_request(data, count)

    @precondition(lambda self: self.on_own_clock or self.run.state.busy())
    @rule(count=STEP_COUNTS, transfers_done=st.booleans())
    def step(self, count: int, transfers_done: bool) -> None:
        """Step both engines `count` times; with `transfers_done`, every in-flight transfer succeeds before each
        step."""
        for _ in range(count):
            if transfers_done and not self.on_own_clock:
                self.apply("complete_transfers", False, False)
            self.apply("step")

    @precondition(lambda self: not self.on_own_clock and self.run.state.transfers_pending())
    @rule(fail_loads=SOMETIMES, fail_stores=SOMETIMES, in_step=SOMETIMES)
    def complete_transfers(self, fail_loads: bool, fail_stores: bool, in_step: bool) -> None:
        """Complete every transfer in flight; with `in_step`, inside the next step, where the worker polls them
        (CONN-STEP-4)."""
        failures = self.run.capabilities.transfer_failures
        outcome = TransferOutcome(fail_loads=fail_loads and failures, fail_stores=fail_stores and failures)
        if in_step and self.run.capabilities.complete_in_step:
            self.apply("step", outcome)
        else:
            self.apply("complete_transfers", outcome.fail_loads, outcome.fail_stores)

    @precondition(lambda self: self.run.capabilities.abort and (self.on_own_clock or self.run.state.unfinished()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = self.pick(data, self.run.state.unfinished())
        if request_id is not None:
            self.apply("abort", request_id)

    def load_interruptions(self) -> list[str]:
        """Return what the adapter lets a program do while loads are in flight: abort one, fail them, reset the
        prefix cache (and the connector, where it can); on the connector's clock, only abort."""
        capabilities = self.run.capabilities
        offered = {"abort": capabilities.abort, "fail": capabilities.transfer_failures, "reset": True}
        return [action for action, supported in offered.items()
                if supported and (action == "abort" or not self.on_own_clock)]

    @precondition(lambda self: self.load_interruptions() and (self.on_own_clock or self.run.state.loading()))
    @rule(data=st.data())
    def interrupt_loads(self, data: st.DataObject) -> None:
        """Abort a request whose load is in flight, fail every load in flight, or reset the prefix cache while they
        are: one rule for the short window, so that each of them is drawn in every mode (LIFE-ABORT-1, LIFE-LOAD-3,
        KVC-FAIL-1, OFF-MGR-8)."""
        action = data.draw(st.sampled_from(self.load_interruptions()), label="interruption")
        if action == "fail":
            self.apply("complete_transfers", True, False)
        elif action == "reset":
            self.apply("reset_prefix_cache", self.run.capabilities.reset_connector)
        elif (request_id := self.pick(data, self.run.state.loading())) is not None:
            self.apply("abort", request_id)

    @precondition(lambda self: self.run.capabilities.preemption and (self.on_own_clock or self.run.state.running()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        request_id = self.pick(data, self.run.state.running())
        if request_id is not None:
            self.apply("preempt", request_id)

    @precondition(lambda self: self.run.capabilities.preemption and (self.on_own_clock or self.run.state.storing()))
    @rule(data=st.data())
    def preempt_while_storing(self, data: st.DataObject) -> None:
        """Preempt a request whose stores are in flight: a rule of its own, as the window is short (LIFE-FREE-2)."""
        request_id = self.pick(data, self.run.state.storing())
        if request_id is not None:
            self.apply("preempt", request_id)

    @rule(reset_connector=SOMETIMES)
    def reset_prefix_cache(self, reset_connector: bool) -> None:
        self.apply("reset_prefix_cache", reset_connector and self.run.capabilities.reset_connector)

    @precondition(lambda self: self.on_own_clock or self.run.state.busy())
    @rule()
    def drain(self) -> None:
        self.drain_engine()

    @invariant()
    def count_rules(self) -> None:
        """Count the rules run (Hypothesis's stateful steps), for the harness's throughput."""
        self.session.statistics.rules += 1

    def teardown(self) -> None:
        """End every example idle: a last drain checks for leaks and liveness (LIFE-LEAK-1, LIFE-LIVE-1)."""
        try:
            if self.run.started and not self.run.failed:
                self.run.apply(Call("drain"))
        except Diverged:  # a known failure in the last drain ends the example as anywhere else (CONF-RUN-2)
            pass
        finally:
            self.run.close()


MALFORMED_FORWARDS: st.SearchStrategy[dict[str, object]] = st.sampled_from((
    {"do_remote_prefill": None}, {"remote_block_ids": None}, {"remote_engine_id": None},
    {"remote_engine_id": "no-such-engine"}, {"remote_request_id": "no-such-request"}, {"remote_block_ids": [1]}))
"""Params a proxy may forward wrong: a field missing (PD-PARAMS-2), or naming an engine, request or blocks the producer
does not hold (PD-FAIL-1)."""


class PairStateMachine(ConnectorStateMachine):
    """Draws programs for a producer/consumer pair (chapter `disaggregated`): the rules of one engine, whose
    `add_request` goes to the consumer, plus P/D requests in rules of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.prefills: list[str] = []
        self.decoded: set[str] = set()

    @precondition(lambda self: self.live_requests() < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), then=st.sampled_from(("wait", "hand_over", "abort")))
    def prefill(self, data: st.DataObject, then: str) -> None:
        """Send a new prompt to the producer, as a P/D proxy does: one token to generate, its KV for the consumer; then
        forward its params to the consumer as soon as they return (`hand_over`), as the proxy then does, or abort it
        after a step, while its prefill may be in flight (`abort`, PD-ABORT-1)."""
        spec = data.draw(new_requests(f"r{len(self.run.requests)}"), label="request")
        self.added_since_drain += 1
        self.prefills.append(spec.request_id)
        self.apply("prefill", spec.model_copy(update={"max_tokens": 1, "skip_reading_prefix_cache": False}))
        if then == "hand_over" and self.live_requests() < MAX_LIVE_REQUESTS:
            self.forward(data, spec.request_id, None)
        elif then == "abort" and self.run.capabilities.abort:
            self.apply("step")
            if spec.request_id in self.run.state.unfinished():
                self.apply("abort", spec.request_id)

    def undecoded(self) -> list[str]:
        """Return the prefills not decoded yet: those that returned their params, where the harness completes
        transfers; on the connector's clock, every one (the decode rule waits for its params)."""
        waiting = [request_id for request_id in self.prefills if request_id not in self.decoded]
        return waiting if self.on_own_clock else [r for r in waiting if r in self.run.returned_params]

    @precondition(lambda self: self.undecoded() and self.live_requests() < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), malformed=SOMETIMES)
    def decode(self, data: st.DataObject, malformed: bool) -> None:
        """Forward a finished prefill's params to the consumer with its prompt, sometimes malformed (PD-PARAMS-2,
        PD-FAIL-1); on the connector's clock, first step the pair until the prefill returned them, within the drain
        deadline."""
        prefill_id = self.pick(data, self.undecoded())
        if prefill_id is not None:
            self.forward(data, prefill_id, data.draw(MALFORMED_FORWARDS, label="malformed") if malformed else None)

    def forward(self, data: st.DataObject, prefill_id: str, override: dict[str, object] | None) -> None:
        """Step the pair until the prefill returned its params, within the drain deadline (on a harness clock, within
        the drain's steps), then send its prompt to the consumer with them, `override`'s fields in place."""
        deadline, steps = time.monotonic() + self.session.drain_timeout, 0
        while prefill_id not in self.run.returned_params and time.monotonic() < deadline and (
                self.on_own_clock or steps < DRAIN_STEP_LIMIT) and (self.on_own_clock or self.run.state.busy()):
            self.apply("step")
            steps += 1
        if prefill_id not in self.run.returned_params:
            return
        self.decoded.add(prefill_id)
        before = self.run.requests[prefill_id]
        spec = RequestSpec(request_id=f"r{len(self.run.requests)}", prompt=before.prompt,
                           max_tokens=data.draw(MAX_TOKENS, label="max_tokens"), cache_salt=before.cache_salt,
                           lora_name=before.lora_name)
        self.added_since_drain += 1
        self.apply("decode", spec, prefill_id, *([override] if override is not None else []))
        read = data.draw(st.sampled_from(("later", "now", "failed")), label="read")
        if read != "later" and not self.on_own_clock:  # the read in flight, completed or failed in transit (PD-FAIL-1)
            self.apply("step")
            self.apply("complete_transfers", read == "failed" and self.run.capabilities.transfer_failures, False)


def machine_for(session: Session) -> type[ConnectorStateMachine]:
    """Return a state-machine class that runs the examples of `session`: a pair's, for an adapter of the disaggregated
    level (its own rules leave every other adapter's draws as they were)."""
    name = getattr(session.adapter_factory, "__name__", "Adapter")
    base = PairStateMachine if "disaggregated" in probe_levels(session) else ConnectorStateMachine
    return type(f"{base.__name__}_{name}", (base,), {"session": session})


def probe_levels(session: Session) -> tuple[str, ...]:
    """Return the levels the adapter reports: as the session knows them, or from one adapter built for the purpose
    and closed; none where that fails: the run's first execution then reports the failure under its clause
    (CONF-CAP-1)."""
    if session.capabilities is not None:
        return tuple(session.capabilities.levels)
    try:
        adapter = session.adapter_factory()
    except Exception:  # the executions report it, with the clause it breaks
        return ()
    try:
        return tuple(adapter.capabilities().levels)
    except Exception:
        return ()
    finally:
        with contextlib.suppress(Exception):
            adapter.close()
