"""Shrinking a failing program to a small one that fails the same way (chapter `conformance`, CONF-RUN-3).

Hypothesis finds the failing program; the shrinker then edits the program itself. Each candidate is run
by a fresh `Execution`, with no Hypothesis draws in the way: a replay costs what its engine steps cost.
Edits, tried until none helps or the profile's attempts are spent: drop a whole request (the call that creates it,
`add_request`, `prefill` or `decode`, and every call naming it: a prefill's decodes go with it, and what names them),
drop runs of calls (halving their length down to single calls), put one drain in place of steps in a row (where the
harness completes transfers: a drain is as many steps, cheap), and simplify values (shorter prompts, one output token,
no flags or tenant, no params replaced in a forward, the plainest engine configuration with the fewest ranks; a
prefill's prompt, tenant and adapter together with those of its decodes, which read its KV).

The budget is a number of replays, not seconds, so that the counterexample a run reports is the same on a
busy machine as on an idle one. A wall-clock cap stays as a last resort, for adapters whose replays are so
slow that the attempts would take hours; a shrink it cuts short says so in its message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvconform.common.values import Capabilities, EngineConfig, RequestSpec
from kvconform.conformance.execution import Call, Replay, Session, replay
from kvconform.conformance.judging.judge import ClauseViolation

REPLAYS_PER_CANDIDATE = 3
"""Times a candidate of a connector on its own clock is replayed before it is dropped: whether it fails depends on
when the connector's threads finish, so one passing replay does not show that a program cannot fail."""

SAFETY_CAP_SECONDS = 600.0
"""The last resort: a shrink stops after this long whatever attempts are left, and its message says it was cut short."""

PROGRESS_SECONDS = 10.0
"""A shrink that lasts longer says how far it got this often (to `on_progress`), so that a long one is not silent."""

ROOMY_CONFIG = {"num_gpu_blocks": 64, "num_offload_blocks": 12, "max_num_batched_tokens": 256}
"""Engine settings under which nothing has to be preempted, evicted or chunked: the simplest there are."""


@dataclass(frozen=True)
class Failure:
    """What makes two failures the same: the clause, and for a raising adapter the exception's type."""

    clause: str
    raised: str = ""

    @classmethod
    def of(cls, violation: ClauseViolation) -> Failure:
        raised = violation.detail.split(" raised ", 1)[1].split(":", 1)[0] if violation.clause == "CONF-CALL-1" else ""
        return cls(violation.clause, raised)


class Shrinker:
    """Shrinks programs of one session's adapter, keeping the failure they show."""

    def __init__(self, session: Session, capabilities: Capabilities, attempts: int,
                 cap_seconds: float = SAFETY_CAP_SECONDS, on_progress: Callable[[str], None] | None = None) -> None:
        self.session = session
        self.on_progress = on_progress
        self.attempts = attempts
        self.cap_seconds = cap_seconds
        self.replays = 0
        self.tries = 1 if capabilities.harness_completes_transfers else REPLAYS_PER_CANDIDATE
        self.plain_config = {
            **ROOMY_CONFIG,
            "block_size_factor": min(capabilities.block_size_factors),
            "eviction_policy": "lru" if "lru" in capabilities.eviction_policies else capabilities.eviction_policies[0],
            "async_scheduling": session.scheduling == "async",
            "tensor_parallel_size": session.tensor_parallel_size or min(capabilities.tensor_parallel_sizes),
        }

    def replay(self, program: list[Call]) -> Replay:
        """Run `program` afresh; every replay counts against the attempts budget."""
        self.replays += 1
        return replay(self.session, program)

    def fails_alike(self, program: list[Call], failure: Failure) -> Replay | None:
        """Return a replay of `program` that fails with `failure`, trying it as many times as the adapter's clock
        asks (`REPLAYS_PER_CANDIDATE`), or None."""
        for _ in range(self.tries):
            replay = self.replay(program)
            if fails_as(replay, failure):
                return replay
        return None

    def shrink(self, failing: Replay) -> Replay:
        """Return the smallest program found within the attempts budget that fails as `failing` does.

        The failure is judged on the program as it ran: one that no replay makes fail the same way is returned as
        it is, as the counterexample, and its message says how many replays reproduced it; so is a shrink the
        safety cap cut short.
        """
        failure, best = Failure.of(failing.failure), failing
        started = time.perf_counter()
        cap, next_report = started + self.cap_seconds, started + PROGRESS_SECONDS
        reproduced = sum(fails_as(self.replay(failing.program), failure) for _ in range(self.tries))
        if reproduced < self.tries:
            failing.failure.detail += (f" (observed; {reproduced} of {self.tries} replays of this program failed the "
                                       "same way: the adapter is not deterministic)")
        if not reproduced:
            return failing
        progress = True
        while progress and self.replays < self.attempts:
            progress = False
            for candidate in self.candidates(best.program):
                if self.replays >= self.attempts:
                    break
                if time.perf_counter() >= cap:
                    best.failure.detail += (f" (shrinking stopped at the {self.cap_seconds:g} s safety cap after "
                                            f"{self.replays} of {self.attempts} replays: a smaller program may fail "
                                            "too)")
                    return best
                replay = self.fails_alike(candidate, failure)
                if replay is not None and size(replay.program) < size(best.program):
                    best, progress = replay, True
                if time.perf_counter() >= next_report:
                    next_report = time.perf_counter() + PROGRESS_SECONDS
                    self.report(failure, best, started)
                if progress:
                    break
        return best

    def report(self, failure: Failure, best: Replay, started: float) -> None:
        """Say how far the shrink has got: replays spent, and the size of the smallest failing program so far."""
        if self.on_progress is not None:
            requests, calls, _ = size(best.program)
            self.on_progress(f"shrinking {failure.clause}: {self.replays} of {self.attempts} replays in "
                             f"{time.perf_counter() - started:.0f}s; smallest failing program so far: {requests} "
                             f"requests, {calls} calls")

    def candidates(self, program: list[Call]) -> Iterator[list[Call]]:
        """Yield edits of `program`, the ones that remove most first."""
        for request_id in reversed([call.creates for call in program if call.creates is not None]):
            yield without_request(program, request_id)
        length = len(program) // 2
        while length >= 1:
            for first in range(len(program) - length, 0, -length):
                yield program[:first] + program[first + length:]
            length //= 2
        for first, last in reversed(step_runs(program) if self.tries == 1 else []):  # a harness clock's steps
            yield program[:first] + [Call("drain")] + program[last:]
        for position, call in enumerate(program):
            for simpler in self.simpler(call):
                yield program[:position] + [simpler] + program[position + 1:]
        for call in program:
            if call.operation == "prefill":
                yield from simpler_prefills(program, call.args[0])

    def simpler(self, call: Call) -> Iterator[Call]:
        """Yield `call` with one value made simpler, within the adapter's capabilities and the run's scheduling."""
        if call.operation == "start":
            config: EngineConfig = call.args[0]
            for name, plain in self.plain_config.items():
                if getattr(config, name) != plain:
                    yield Call("start", (config.model_copy(update={name: plain}),))
        elif call.operation == "add_request":
            spec: RequestSpec = call.args[0]
            for shorter in shorter_prompts(spec):
                yield Call("add_request", (spec.model_copy(update={"prompt": shorter}),))
            for name, simplest in (("max_tokens", 1), ("skip_reading_prefix_cache", False), ("cache_salt", None),
                                   ("lora_name", None)):
                if getattr(spec, name) != simplest:
                    yield Call("add_request", (spec.model_copy(update={name: simplest}),))
        elif call.operation in ("prefill", "decode"):
            # the prompt, tenant and adapter a decode shares with its prefill change with the prefill's
            # (`simpler_prefills`)
            if call.args[0].max_tokens != 1:
                yield Call(call.operation, (call.args[0].model_copy(update={"max_tokens": 1}), *call.args[1:]))
            if call.operation == "decode" and len(call.args) > 2:
                yield Call("decode", call.args[:2])  # the params as the producer returned them, none replaced
        elif call.operation in ("complete_transfers", "reset_prefix_cache"):
            for position, value in enumerate(call.args):
                if value:
                    yield Call(call.operation, call.args[:position] + (False,) + call.args[position + 1:])


def fails_as(replay: Replay, failure: Failure) -> bool:
    return replay.violation is not None and Failure.of(replay.violation) == failure


def step_runs(program: list[Call]) -> list[tuple[int, int]]:
    """Return where a program has two or more plain steps in a row, each run as (first, past its last): a drain, one
    call, steps until the engine is idle as they do (a lease that never ends, a read that never completes)."""
    runs, first = [], None
    for position, call in enumerate([*program, Call("drain")]):
        plain = call.operation == "step" and not call.args
        if plain and first is None:
            first = position
        elif not plain and first is not None:
            if position - first >= 2:
                runs.append((first, position))
            first = None
    return runs


def shorter_prompts(spec: RequestSpec) -> list[tuple[int, ...]]:
    """Return the shorter prompts to try for a request, the shortest first."""
    lengths = sorted({len(spec.prompt) // 2, len(spec.prompt) - 4, len(spec.prompt) - 1})
    return [spec.prompt[:length] for length in lengths if 0 < length < len(spec.prompt)]


def simpler_prefills(program: list[Call], prefill: RequestSpec) -> Iterator[list[Call]]:
    """Yield `program` with the prefill of `prefill` simpler, and its decodes alike: a shorter prompt, no tenant, no
    adapter. A decode asks for the KV of its prefill's prompt, so the two change together."""
    def edited(update: dict[str, object]) -> list[Call]:
        def each(call: Call) -> Call:
            if prefill.request_id in (call.creates, call.args[1] if call.operation == "decode" else None):
                return Call(call.operation, (call.args[0].model_copy(update=update), *call.args[1:]))
            return call
        return [each(call) for call in program]

    for shorter in shorter_prompts(prefill):
        yield edited({"prompt": shorter})
    for name in ("cache_salt", "lora_name"):
        if getattr(prefill, name) is not None:
            yield edited({name: None})


def _requests_named(call: Call) -> set[str]:
    """Return the requests a call names: the one it creates, the prefill whose params a decode forwards, the one an
    abort or a preemption acts on."""
    if call.operation == "decode":
        return {call.args[0].request_id, call.args[1]}
    if call.creates is not None:
        return {call.creates}
    if call.operation in ("abort", "preempt"):
        return {call.args[0]}
    return set()


def without_request(program: list[Call], request_id: str) -> list[Call]:
    """Return `program` without request `request_id`: without the call that creates it and every call naming it. A
    prefill goes with the decodes that forward its params (a decode of a prefill that returned nothing is not run,
    `Execution.allows`), and those with the calls naming them."""
    gone = {request_id} | {call.args[0].request_id for call in program
                           if call.operation == "decode" and call.args[1] == request_id}
    return [call for call in program if not _requests_named(call) & gone]


def size(program: list[Call]) -> tuple[int, int, int]:
    """Return how big a program is: its requests, then its calls, then the sum of its values."""
    specs = [call.args[0] for call in program if call.creates is not None]
    values = sum(len(spec.prompt) + spec.max_tokens + bool(spec.skip_reading_prefix_cache) + bool(spec.cache_salt)
                 + bool(spec.lora_name) for spec in specs)
    values += sum(len(call.args[2]) for call in program if call.operation == "decode" and len(call.args) > 2)
    values += sum(sum(map(bool, call.args)) for call in program if call.operation in ("complete_transfers",
                                                                                       "reset_prefix_cache"))
    config = next((call.args[0] for call in program if call.operation == "start"), None)
    if config is not None:
        values += sum(getattr(config, name) != plain for name, plain in ROOMY_CONFIG.items())
        values += (config.block_size_factor + (config.eviction_policy != "lru") + config.async_scheduling
                   + config.tensor_parallel_size - 1)
    return len(specs), len(program), values
