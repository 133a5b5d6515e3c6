"""Scenarios: fixed programs with what the spec requires of them (chapter `conformance`, issue 14).

A scenario is JSON: `config` (EngineConfig fields: its `start`), `level` (the spec level it needs, "connector",
"offloading" or "disaggregated"), an optional `clause` it illustrates, `ops` and `order`. Each op is an operation of
`operations.OPERATIONS` written as programs write calls, `{"op": name, "args": {...}}`; a `step` may carry
`expect`, a subset of `StepObservation` fields that must match exactly, and `clauses`, the clause each expected field
enforces (the scenario's `clause` if left out). A prompt may name another request's tokens (`{"tokens_of": R}`: R's
prompt and all it decodes; `{"output_of": R}`: what it decodes).

`order` states what may happen at any step a correct implementation chooses, as connectors on their own clock do:
`{"event": {"freed": "b"}, "not_before": {"loads_finished": "b"}}` says request b's blocks are freed, and no
earlier than the step that reports its load finished (the same step or later). Both must happen by the end.

A scenario compiles to the calls the state machine makes and runs through the same execution (`Execution`): every
call under the deadline, every answer validated and judged by the checks of each level the adapter reports, a raise
under the clause of the call; the expectations are judged after the step they follow. `Scenario` builds one in
Python. An adapter lacking the level, the configuration or an operation a scenario needs refuses it (`Unsupported`):
a scenario whose transfers the harness completes needs an adapter whose transfers the harness holds
(`Capabilities.harness_completes_transfers`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.values import (
    VARIANTS,
    Capabilities,
    EngineConfig,
    RequestSpec,
    SpecLevel,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterHung
from kvconform.conformance.execution import Diverged, Execution, Session
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.operations import OPERATIONS, Call, ProgramError
from kvconform.reference.errors import InvalidCall
from kvconform.reference.kv_history import RequestHistory

SCENARIO_OPERATIONS = tuple(name for name in OPERATIONS if name != "start")
"""The operations a scenario's `ops` may use: its `config` is its `start`."""

REQUEST_EVENTS = ("finished", "freed", "preempted", "loads_finished", "loads_failed", "free_delayed", "saves_finished")
"""The `StepObservation` fields that list requests: what an `order` entry names an event by."""


class ScenarioOp(BaseModel):
    """One operation of a scenario file: a call, and for a step what it must observe."""

    model_config = ConfigDict(extra="forbid")
    op: Literal[SCENARIO_OPERATIONS]  # type: ignore[valid-type]
    args: dict[str, Any] = Field(default_factory=dict, description="the call's arguments, by parameter name")
    expect: dict[str, Any] = Field(default_factory=dict, description="of a step: StepObservation fields, "
                                                                     "as JSON, that must match exactly")
    clauses: dict[str, str] = Field(default_factory=dict, description="the clause each expected field enforces")

    @model_validator(mode="after")
    def _known_fields(self) -> ScenarioOp:
        unknown = set(self.expect) - StepObservation.model_fields.keys()
        if unknown:
            raise ValueError(f"expectations on unknown observation fields: {sorted(unknown)}")
        if self.op != "step" and (self.expect or self.clauses):
            raise ValueError(f"only a step has expectations, not {self.op}")
        return self


class Order(BaseModel):
    """An event that must happen at whichever step the implementation chooses, but no earlier than another."""

    model_config = ConfigDict(extra="forbid")
    event: dict[str, str] = Field(description="one StepObservation field that lists requests, and the request: "
                                              "it must be listed there by the scenario's end")
    not_before: dict[str, str] = Field(description="the same: the event must not happen before this one did")
    clause: str | None = Field(None, description="the clause it enforces; the scenario's if left out")

    @model_validator(mode="after")
    def _one_event_each(self) -> Order:
        for event in (self.event, self.not_before):
            if len(event) != 1 or not set(event) <= set(REQUEST_EVENTS):
                raise ValueError(f"an event is one of {', '.join(REQUEST_EVENTS)} with a request id, not {event}")
        return self


class ScenarioFile(BaseModel):
    """A scenario file, as `kvconform replay FILE` reads it (issue 14)."""

    model_config = ConfigDict(extra="forbid")
    description: str = ""
    level: SpecLevel = Field("offloading", description="the spec level the scenario needs")
    clause: str = Field("SCENARIO", description="the clause it illustrates: reported for expectations without one")
    config: EngineConfig
    ops: list[ScenarioOp]
    order: list[Order] = Field(default_factory=list, description="events allowed at any step, in this order")


class Unsupported(Exception):
    """The adapter lacks what the scenario needs: its spec level, or an operation its capabilities rule out."""


class ScenarioError(ValueError):
    """A scenario that is not one: a malformed file, or a call the engine's state refuses (one line)."""


@dataclass(frozen=True)
class Verdict:
    """What a scenario showed on an adapter: passed, failed a clause (a known failure's or another), refused, or
    unknown (a call hung)."""

    scenario: str
    outcome: Literal["pass", "fail", "known failure", "refused", "unknown"]
    clause: str | None = None
    detail: str = ""
    adapter_traceback: str | None = None


@dataclass
class Scenario:
    """A scenario: requests, steps and what each step must show, built in Python or read from JSON (issue 14).

    `Scenario(config).add("r", [0] * 12).step(stored=[("r", (0,))]).run(adapter)`; `step` keywords are
    `StepObservation` fields, plus the shorthands `stored` and `flushed`, (request, indices) pairs of completed
    and flushed stores, `loaded`, (request, indices, first GPU block, GPU blocks) of completed loads, and
    `looked_up=False` (no lookup); `clauses` names the clause an expected field enforces (the scenario's if not);
    `complete_transfers=True` (or a `TransferOutcome`) finishes the transfers inside the step. `order` adds an
    event allowed at any step, no earlier than another. A prompt may hold `tokens_of(R)` or `output_of(R)`: the
    tokens an earlier request decodes.
    """

    config: EngineConfig
    level: SpecLevel = "offloading"
    clause: str = "SCENARIO"
    description: str = ""
    name: str = "scenario"
    ops: list[dict[str, Any]] = field(default_factory=list)
    orders: list[dict[str, Any]] = field(default_factory=list)

    # --- the JSON form -----------------------------------------------------------------------

    @classmethod
    def from_json(cls, name: str, data: Any) -> Scenario:
        """Return the scenario `data` describes; raise ScenarioError, one line, on a malformed one."""
        try:
            scenario = ScenarioFile.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            raise ScenarioError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        config = EngineConfig(**data["config"])  # its set fields tell `run` which variants the scenario leaves open
        built = cls(config, scenario.level, scenario.clause, scenario.description, name,
                    [op.model_dump(exclude_defaults=True) for op in scenario.ops],
                    [order.model_dump(exclude_none=True) for order in scenario.order])
        built.calls()  # refuse a bad argument or request reference where it is read
        return built

    def to_json(self) -> dict[str, Any]:
        data = {"description": self.description, "level": self.level, "clause": self.clause,
                "config": self.config.model_dump(mode="json", exclude_unset=True), "ops": list(self.ops)}
        return data | ({"order": list(self.orders)} if self.orders else {})

    def calls(self) -> list[Call]:
        """Return the calls the ops make, `start` first, each prompt's references to earlier requests resolved;
        raise ScenarioError naming the op that is not a call."""
        calls = [Call("start", (self.config,))]
        requests: dict[str, RequestSpec] = {}
        for number, op in enumerate(self.ops):
            try:
                if op["op"] == "add_request":
                    request = request_spec(op.get("args", {}), requests)
                    requests[request.request_id] = request
                    calls.append(Call("add_request", (request,)))
                else:
                    calls.append(Call.from_json({"op": op["op"], "args": op.get("args", {})}))
            except (ProgramError, ValueError, TypeError, KeyError) as error:
                raise ScenarioError(f"ops.{number}: {error}") from None
        return calls

    # --- building in Python --------------------------------------------------------------------

    def call(self, operation: str, *args: Any) -> Scenario:
        """Append the call `operation(*args)`, in its JSON form."""
        self.ops.append(Call(operation, args).to_json())
        return self

    def add(self, request_id: str, prompt: list[int | dict[str, str]], max_tokens: int = 1, **spec: Any) -> Scenario:
        args = {"request_id": request_id, "prompt": list(prompt), "max_tokens": max_tokens, **spec}
        request_spec(args, self._requests())  # refuse a bad request where it is written
        self.ops.append({"op": "add_request", "args": _json(args)})
        return self

    def _requests(self) -> dict[str, RequestSpec]:
        return {call.args[0].request_id: call.args[0] for call in self.calls() if call.operation == "add_request"}

    def step(self, *, loaded: Any = None, stored: Any = None, flushed: Any = None, looked_up: bool | None = None,
             complete_transfers: bool | TransferOutcome = False, clauses: dict[str, str] | None = None,
             **expect: Any) -> Scenario:
        for name, pairs in (("completed_loads", loaded), ("completed_stores", stored), ("flushed_stores", flushed)):
            if pairs is not None:
                expect[name] = [self._job(name, *job) for job in pairs]
        if looked_up is False:
            expect["lookups"] = {}
        outcome = TransferOutcome() if complete_transfers is True else complete_transfers or None
        op = Call("step", () if outcome is None else (outcome,)).to_json()
        if expect:
            op["expect"] = _json(expect)
        if clauses:
            op["clauses"] = clauses
        ScenarioOp.model_validate(op)  # refuse an unknown field where it is written
        self.ops.append(op)
        return self

    @staticmethod
    def _job(name: str, request_id: str, indices: Any, *gpu_blocks: int) -> dict[str, Any]:
        job = {"request_id": request_id, "offload_indices": list(indices)}
        if name == "completed_loads":
            first_gpu_block, num_gpu_blocks = gpu_blocks
            return job | {"first_gpu_block": first_gpu_block, "num_gpu_blocks": num_gpu_blocks}
        return job | {"evicted": []}

    def complete_transfers(self, fail_loads: bool = False, fail_stores: bool = False) -> Scenario:
        """Let every transfer in flight finish now, between steps: the harness holds them."""
        return self.call("complete_transfers", fail_loads, fail_stores)

    def reset_prefix_cache(self, reset_connector: bool = False) -> Scenario:
        return self.call("reset_prefix_cache", reset_connector)

    def drain(self) -> Scenario:
        """Step until the engine is idle: every request finished, nothing in flight; then check leaks and liveness."""
        return self.call("drain")

    def abort(self, request_id: str) -> Scenario:
        return self.call("abort", request_id)

    def preempt(self, request_id: str) -> Scenario:
        return self.call("preempt", request_id)

    def order(self, event: tuple[str, str], not_before: tuple[str, str], clause: str | None = None) -> Scenario:
        """Require `event` (field, request) by the end, at any step no earlier than `not_before` happened."""
        entry = {"event": dict([event]), "not_before": dict([not_before])} | ({"clause": clause} if clause else {})
        Order.model_validate(entry)
        self.orders.append(entry)
        return self

    # --- running --------------------------------------------------------------------------------

    def run(self, adapter: KVConnectorAdapter, call_timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
        """Run on `adapter`; raise `ClauseViolation` at the first failure: a check's, or an unmet expectation's with a
        per-step diff; raise `Unsupported` if the adapter cannot run it."""
        check(self, Session(lambda: adapter, call_timeout))


def load(name: str) -> Scenario:
    """Return the bundled scenario `name` (a file `scenarios/<name>.json`)."""
    bundled = resources.files(__package__).joinpath("scenarios").joinpath(f"{name}.json")
    return Scenario.from_json(name, json.loads(bundled.read_text()))


def load_file(path: Path) -> Scenario:
    """Return the scenario in a user's JSON file; raise ScenarioError (or OSError) on a malformed one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ScenarioError(f"not JSON: {error}") from None
    return Scenario.from_json(path.stem, data)


def bundled() -> list[str]:
    """Return the names of the bundled scenarios."""
    folder = resources.files(__package__).joinpath("scenarios")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def check(scenario: Scenario, session: Session) -> None:
    """Run `scenario` through an `Execution` of `session`: raise `Unsupported` if the adapter cannot run it,
    `ClauseViolation` at its first failure (`Diverged` from it for a failure of a clause the session's baseline lists,
    which ends the scenario as it ends an example: CONF-RUN-2), `AdapterHung` if a call hangs (CONF-CALL-2),
    `ScenarioError` if the engine's state refuses one of its calls."""
    execution = Execution(session, coverage={})
    try:
        execution.begin()
        start, *calls = _supported(scenario, execution.capabilities)
        _apply(execution, scenario, "config", start)
        events = Events()
        for number, call in enumerate(calls):
            where = f"op {number} ({call.operation})"
            _apply(execution, scenario, where, call)
            events.seen(execution.observations)
            if call.operation == "step":
                _expect(scenario, number, execution.observations[-1].model_dump(mode="json"),
                        scenario.ops[number].get("expect", {}), scenario.ops[number].get("clauses", {}))
            events.judge(scenario, where)
        events.judge(scenario, "end", ended=True)
    except BaseException:
        with contextlib.suppress(ClauseViolation, AdapterHung):  # the first failure is the verdict
            execution.close()
        raise
    execution.close()


def _apply(execution: Execution, scenario: Scenario, where: str, call: Call) -> None:
    """Apply `call`; a failure names the scenario and the op (`where`), a call the engine refuses is the scenario's."""
    try:
        execution.apply(call)
    except (ClauseViolation, AdapterHung, Diverged) as failure:
        named = failure.known_failure if isinstance(failure, Diverged) else failure
        named.detail = f"scenario {scenario.name}, {where}: {named.detail}"
        named.args = (f"[{named.clause}] {named.detail}",)
        raise
    except InvalidCall as error:
        raise ScenarioError(f"scenario {scenario.name}, {where}: the engine refuses {call}: {error}") from None


def judge(scenario: Scenario, session: Session) -> Verdict:
    """Return the verdict of `scenario` on the adapter of `session` (`check`'s outcome as a value)."""
    try:
        check(scenario, session)
    except Unsupported as refused:
        return Verdict(scenario.name, "refused", detail=str(refused))
    except Diverged as diverged:
        known = diverged.known_failure
        return Verdict(scenario.name, "known failure", known.clause, known.detail, known.adapter_traceback)
    except ClauseViolation as violation:
        outcome: Literal["known failure", "fail"] = "known failure" if session.baseline.tolerates(violation) else "fail"
        return Verdict(scenario.name, outcome, violation.clause, violation.detail, violation.adapter_traceback)
    except AdapterHung as hung:
        return Verdict(scenario.name, "unknown", hung.clause, hung.detail)
    return Verdict(scenario.name, "pass")


def _supported(scenario: Scenario, capabilities: Capabilities) -> list[Call]:
    """Return the scenario's calls for an adapter of `capabilities`, its `start` with the variants the scenario leaves
    open set to the adapter's; raise Unsupported if the adapter cannot run them (CONF-CAP-1)."""
    if scenario.level not in capabilities.levels:
        raise Unsupported(f"{scenario.name} needs the {scenario.level} level; the adapter reports "
                          f"{capabilities.levels}")
    unset = [name for name in VARIANTS if name not in scenario.config.model_fields_set]  # expectations hold for each
    config = scenario.config.model_copy(update={name: getattr(capabilities, name)[0] for name in unset})
    if (lacking := capabilities.lacks(config)) is not None:
        raise Unsupported(f"{scenario.name} needs what the adapter lacks: it supports {lacking}")
    calls = [Call("start", (config,)), *scenario.calls()[1:]]
    for call in calls:
        if (reason := call.unsupported(capabilities)) is not None:
            raise Unsupported(f"{scenario.name} needs {reason}")
    return calls


@dataclass
class Events:
    """The step at which each request event (a field of `REQUEST_EVENTS`, a request) first happened."""

    first: dict[tuple[str, str], int] = field(default_factory=dict)
    steps: int = 0

    def seen(self, observations: list[StepObservation]) -> None:
        for observation in observations[self.steps:]:
            for name in REQUEST_EVENTS:
                for request_id in getattr(observation, name):
                    self.first.setdefault((name, request_id), self.steps)
            self.steps += 1

    def judge(self, scenario: Scenario, where: str, ended: bool = False) -> None:
        """Raise `ClauseViolation` for an `order` entry broken by now: its event before the one it must not precede,
        or, at the end, its event never."""
        for order in scenario.orders:
            (event,), (before,) = order["event"].items(), order["not_before"].items()
            happened, preceded = self.first.get(event), self.first.get(before)
            late = happened is not None and (preceded is None or preceded > happened)
            if late or (ended and happened is None):
                what = "never happened" if happened is None else f"happened at step {happened}"
                raise ClauseViolation(order.get("clause", scenario.clause), (
                    f"scenario {scenario.name}, {where}: {event[1]!r} in {event[0]} {what}, and must happen no earlier "
                    f"than {before[1]!r} in {before[0]} ({'never' if preceded is None else f'at step {preceded}'})"))


def request_spec(args: dict[str, Any], requests: dict[str, RequestSpec]) -> RequestSpec:
    """Return the request an `add_request` op adds, its prompt's references to earlier requests' tokens resolved."""
    prompt: list[int] = []
    for part in args["prompt"]:
        if isinstance(part, dict):
            prompt.extend(_tokens_of_reference(part, requests))
        else:
            prompt.append(part)
    return RequestSpec(**(args | {"prompt": tuple(prompt)}))


def _tokens_of_reference(part: dict[str, str], requests: dict[str, RequestSpec]) -> tuple[int, ...]:
    """Return the tokens `{"tokens_of": R}` (R's prompt and every token R decodes) or `{"output_of": R}` (only
    the decoded ones) stand for; the KV content function fixes what R decodes (XFER-DATA-2)."""
    (kind, request_id), = part.items()
    if kind not in ("tokens_of", "output_of") or request_id not in requests:
        raise ValueError(f"a prompt part must be {{'tokens_of' or 'output_of': an earlier request id}}, not {part}")
    request = requests[request_id]
    history = RequestHistory((request.cache_salt, request.lora_name), request.prompt, request.max_tokens)
    tokens = history.decoded()
    return tuple(tokens) if kind == "tokens_of" else tuple(tokens[len(request.prompt):])


def _expect(scenario: Scenario, number: int, observation: dict[str, Any], expect: dict[str, Any],
            clauses: dict[str, str]) -> None:
    """Raise `ClauseViolation` with a diff of every expected field the step's observation does not match."""
    observed = {name: _fields_named(observation[name], _json(wanted)) for name, wanted in expect.items()}
    wrong = [name for name, wanted in expect.items() if observed[name] != _json(wanted)]
    if wrong:
        diff = "".join(f"\n  {name}:\n    - expected {_json(expect[name])!r}\n    + observed {observed[name]!r}"
                       for name in wrong)
        raise ClauseViolation(clauses.get(wrong[0], scenario.clause), f"scenario {scenario.name}, op {number} (step): "
                                                                        f"expected vs observed{diff}")


def _fields_named(observed: Any, wanted: Any) -> Any:
    """Return the observed list of records with only the fields the expected records name, where both are lists of
    records of one length: a field an adapter adds and the scenario does not state (`MatchAnswer.num_tokens`) is not
    compared."""
    if (isinstance(observed, list) and isinstance(wanted, list) and len(observed) == len(wanted)
            and all(isinstance(item, dict) for item in observed + wanted)):
        return [{key: item.get(key) for key in want} for item, want in zip(observed, wanted, strict=True)]
    return observed


def tokens_of(request_id: str) -> dict[str, str]:
    """Stand, in a prompt, for an earlier request's prompt followed by every token it decodes."""
    return {"tokens_of": request_id}


def output_of(request_id: str) -> dict[str, str]:
    """Stand, in a prompt, for the tokens an earlier request decodes."""
    return {"output_of": request_id}


def _json(value: Any) -> Any:
    """Return `value` as a JSON round trip gives it, so a Python-built expectation compares as a file's would."""
    return json.loads(json.dumps(value, default=_plain))


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value.model_dump(mode="json")
