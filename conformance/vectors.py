"""Trace vectors: fixed operation sequences with the observations the spec requires of them.

A vector (a scenario) is JSON: `config` (EngineConfig fields), `level` (the spec level it needs,
"connector" or "offloading"), an optional `clause` it illustrates, and `ops`, each
`{"op": name, "args": {...}}`. A `step` op may carry `expect`, a subset of `StepObservation` fields that
must match exactly, and `clauses`, the clause each expected field enforces (the scenario's `clause` if
left out); its `complete_transfers` argument finishes the transfers inside the step. `drain` completes
transfers and steps until the adapter is idle. A prompt may name another request's tokens (`{"tokens_of": R}`:
R's prompt and all it decodes; `{"output_of": R}`: what it decodes). `Scenario` builds one in Python.
"""

from __future__ import annotations

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
from kvconform.conformance.checks import ClauseViolation
from kvconform.conformance.execution import DRAIN_STEP_LIMIT
from kvconform.reference.kv_history import RequestHistory


@dataclass(frozen=True)
class Vector:
    name: str
    description: str
    config: EngineConfig
    ops: tuple[dict[str, Any], ...]
    level: SpecLevel = "offloading"
    clause: str = "SCENARIO"

    def to_json(self) -> dict[str, Any]:
        return {"description": self.description, "level": self.level, "clause": self.clause,
                "config": self.config.model_dump(mode="json", exclude_unset=True), "ops": list(self.ops)}


class ScenarioOp(BaseModel):
    """One operation of a scenario file: an adapter call, and for a step what it must observe."""

    model_config = ConfigDict(extra="forbid")
    op: Literal["add_request", "step", "complete_transfers", "drain", "abort", "preempt", "reset_prefix_cache"]
    args: dict[str, Any] = Field(default_factory=dict, description="the call's keyword arguments")
    expect: dict[str, Any] = Field(default_factory=dict, description="of a step: StepObservation fields, "
                                                                     "as JSON, that must match exactly")
    clauses: dict[str, str] = Field(default_factory=dict, description="the clause each expected field enforces")

    @model_validator(mode="after")
    def _known_fields(self) -> ScenarioOp:
        unknown = set(self.expect) - StepObservation.model_fields.keys()
        if unknown:
            raise ValueError(f"expectations on unknown observation fields: {sorted(unknown)}")
        return self


class ScenarioFile(BaseModel):
    """A scenario (trace vector) file, as `kvconform replay FILE` reads it (issue 14)."""

    model_config = ConfigDict(extra="forbid")
    description: str = ""
    level: SpecLevel = Field("offloading", description="the spec level the scenario needs")
    clause: str = Field("SCENARIO", description="the clause it illustrates: reported for expectations without one")
    config: EngineConfig
    ops: list[ScenarioOp]


class Unsupported(Exception):
    """The adapter lacks what the scenario needs: its spec level, or an operation its capabilities rule out."""


def _unsupported_op(op: dict[str, Any], capabilities: Capabilities) -> str | None:
    """Return why the adapter cannot run `op`, or None if it can."""
    args = op.get("args", {})
    outcome = args.get("complete_transfers", {}) if op["op"] == "step" else args
    if op["op"] == "preempt" and not capabilities.preemption:
        return "preempt(), and the adapter reports preemption=False"
    if op["op"] == "step" and "complete_transfers" in args and not capabilities.complete_in_step:
        return "transfers completed inside a step, and the adapter reports complete_in_step=False"
    if (outcome.get("fail_loads") or outcome.get("fail_stores")) and not capabilities.transfer_failures:
        return "failed transfers, and the adapter reports transfer_failures=False"
    if op["op"] == "reset_prefix_cache" and args.get("reset_connector") and not capabilities.reset_connector:
        return "reset_prefix_cache(reset_connector=True), and the adapter reports reset_connector=False"
    return None


def load(name: str) -> Vector:
    """Return the bundled vector `name` (a file `vectors/<name>.json`)."""
    return from_json(name, json.loads(resources.files(__package__).joinpath("vectors", f"{name}.json").read_text()))


def load_file(path: Path) -> Vector:
    """Return the vector in a user's JSON file; raise ValueError on a malformed one."""
    return from_json(path.stem, json.loads(path.read_text(encoding="utf-8")))


def from_json(name: str, data: dict[str, Any]) -> Vector:
    """Return the vector `data` describes; raise ValueError, one line, on a malformed one."""
    try:
        scenario = ScenarioFile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        raise ValueError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    ops = tuple(op.model_dump(exclude_defaults=True) for op in scenario.ops)
    config = EngineConfig(**data["config"])  # its set fields tell `replay` which variants the scenario leaves open
    return Vector(name, scenario.description, config, ops, scenario.level, scenario.clause)


def bundled() -> list[str]:
    """Return the names of the bundled vectors."""
    folder = resources.files(__package__).joinpath("vectors")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def replay(vector: Vector, adapter: KVConnectorAdapter) -> None:
    """Run the vector's operations on `adapter`; raise `ClauseViolation` at the first unmet expectation."""
    capabilities = adapter.capabilities()
    if vector.level not in capabilities.levels:
        raise Unsupported(f"{vector.name} needs the {vector.level} level; the adapter reports {capabilities.levels}")
    unset = [name for name in VARIANTS if name not in vector.config.model_fields_set]  # expectations hold for each
    config = vector.config.model_copy(update={name: getattr(capabilities, name)[0] for name in unset})
    if (lacking := capabilities.lacks(config)) is not None:
        raise Unsupported(f"{vector.name} needs what the adapter lacks: it supports {lacking}")
    for op in vector.ops:
        if (reason := _unsupported_op(op, capabilities)) is not None:
            raise Unsupported(f"{vector.name} needs {reason}")
    adapter.start(config)
    requests: dict[str, RequestSpec] = {}
    try:
        for number, op in enumerate(vector.ops):
            args = op.get("args", {})
            if op["op"] == "add_request":
                request = request_spec(args, requests)
                requests[request.request_id] = request
                adapter.add_request(request)
            elif op["op"] == "step":
                completion = args.get("complete_transfers")
                observation = adapter.step(**({} if completion is None else
                                              {"complete_transfers": TransferOutcome(**completion)}))
                _expect(vector, number, observation.model_dump(mode="json"), op.get("expect", {}),
                        op.get("clauses", {}))
            elif op["op"] == "drain":
                _drain(vector, number, adapter)
            else:
                getattr(adapter, op["op"])(**args)
    finally:
        adapter.close()


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


def _drain(vector: Vector, number: int, adapter: KVConnectorAdapter) -> None:
    """Complete transfers and step until the adapter is idle; raise `ClauseViolation` if it never is: a request
    still unfinished breaks liveness, anything else still held (blocks, pins, jobs) is a leak."""
    for _ in range(DRAIN_STEP_LIMIT):
        if not any(adapter.resource_usage().model_dump().values()):
            return
        adapter.complete_transfers(fail_loads=False, fail_stores=False)
        adapter.step()
    usage = adapter.resource_usage()
    rule = "LIVE" if usage.unfinished_requests else "LEAK"
    clause = f"LIFE-{rule}-1" if vector.level == "offloading" else f"KVC-{rule}-1"
    raise ClauseViolation(clause, f"scenario {vector.name}, op {number} (drain): still busy after {DRAIN_STEP_LIMIT} "
                                  f"steps: {usage!r}")


def _expect(vector: Vector, number: int, observation: dict[str, Any], expect: dict[str, Any],
            clauses: dict[str, str]) -> None:
    """Raise `ClauseViolation` with a diff of every expected field the step's observation does not match."""
    wrong = [name for name, wanted in expect.items() if observation[name] != _json(wanted)]
    if wrong:
        diff = "".join(f"\n  {name}:\n    - expected {_json(expect[name])!r}\n    + observed {observation[name]!r}"
                       for name in wrong)
        raise ClauseViolation(clauses.get(wrong[0], vector.clause), f"scenario {vector.name}, op {number} (step): "
                                                                      f"expected vs observed{diff}")


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


@dataclass
class Scenario:
    """A scenario built in Python: requests, steps and what each step must show (issue 14).

    `Scenario(config).add("r", [0] * 12).step(stored=[("r", (0,))]).run(adapter)`; `step` keywords are
    `StepObservation` fields, plus the shorthands `stored` and `flushed`, (request, indices) pairs of completed
    and flushed stores, `loaded`, (request, indices, first GPU block, GPU blocks) of completed loads, and
    `looked_up=False` (no lookup); `clauses` names the clause an expected field enforces (the scenario's if not);
    `complete_transfers=True` (or a `TransferOutcome`) finishes the transfers inside the step. A prompt may hold
    `tokens_of(R)` or `output_of(R)`: the tokens an earlier request decodes.
    """

    config: EngineConfig
    level: SpecLevel = "offloading"
    clause: str = "SCENARIO"
    description: str = ""
    ops: list[dict[str, Any]] = field(default_factory=list)

    def add(self, request_id: str, prompt: list[int | dict[str, str]], max_tokens: int = 1, **spec: Any) -> Scenario:
        args = {"request_id": request_id, "prompt": list(prompt), "max_tokens": max_tokens, **spec}
        request_spec(args, self._requests())  # refuse a bad request where it is written
        self.ops.append({"op": "add_request", "args": _json(args)})
        return self

    def _requests(self) -> dict[str, RequestSpec]:
        requests: dict[str, RequestSpec] = {}
        for op in self.ops:
            if op["op"] == "add_request":
                requests[op["args"]["request_id"]] = request_spec(op["args"], requests)
        return requests

    def step(self, *, loaded: Any = None, stored: Any = None, flushed: Any = None, looked_up: bool | None = None,
             complete_transfers: bool | TransferOutcome = False, clauses: dict[str, str] | None = None,
             **expect: Any) -> Scenario:
        for name, pairs in (("completed_loads", loaded), ("completed_stores", stored), ("flushed_stores", flushed)):
            if pairs is not None:
                expect[name] = [self._job(name, *job) for job in pairs]
        if looked_up is False:
            expect["lookups"] = {}
        op: dict[str, Any] = {"op": "step"}
        if complete_transfers is not False:
            outcome = TransferOutcome() if complete_transfers is True else complete_transfers
            op["args"] = {"complete_transfers": outcome.model_dump()}
        if expect:
            op["expect"] = _json(expect)
        if clauses:
            op["clauses"] = clauses
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
        self.ops.append({"op": "complete_transfers", "args": {"fail_loads": fail_loads, "fail_stores": fail_stores}})
        return self

    def reset_prefix_cache(self, reset_connector: bool = False) -> Scenario:
        self.ops.append({"op": "reset_prefix_cache", "args": {"reset_connector": reset_connector}})
        return self

    def drain(self) -> Scenario:
        """Complete transfers and step until the adapter is idle: every request finished, nothing in flight."""
        self.ops.append({"op": "drain"})
        return self

    def abort(self, request_id: str) -> Scenario:
        self.ops.append({"op": "abort", "args": {"request_id": request_id}})
        return self

    def preempt(self, request_id: str) -> Scenario:
        self.ops.append({"op": "preempt", "args": {"request_id": request_id}})
        return self

    def vector(self, name: str = "scenario") -> Vector:
        return from_json(name, {"description": self.description, "level": self.level, "clause": self.clause,
                                "config": self.config.model_dump(mode="json", exclude_unset=True), "ops": self.ops})

    def run(self, adapter: KVConnectorAdapter, name: str = "scenario") -> None:
        """Run on `adapter`; raise `ClauseViolation` with a per-step diff at the first unmet expectation."""
        replay(self.vector(name), adapter)
