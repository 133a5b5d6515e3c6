"""Trace vectors: fixed operation sequences with the observations the spec requires of them.

A vector (a scenario) is JSON: `config` (EngineConfig fields), `level` (the spec level it needs,
"connector" or "offloading"), an optional `clause` it illustrates, and `ops`, each
`{"op": name, "args": {...}}`. A `step` op may carry `expect`, a subset of `StepObservation` fields that
must match exactly, and `clauses`, the clause each expected field enforces (the scenario's `clause` if
left out). `Scenario` builds one in Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvconform.adapters.contract import (VARIANTS, Capabilities, EngineConfig, KVConnectorAdapter, RequestSpec,
                                        SpecLevel, StepObservation)
from kvconform.conformance.checks import ClauseViolation


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
    op: Literal["add_request", "step", "complete_transfers", "abort", "preempt", "reset_prefix_cache"]
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
    if op["op"] == "preempt" and not capabilities.preemption:
        return "preempt(), and the adapter reports preemption=False"
    if op["op"] == "complete_transfers" and (args.get("fail_loads") or args.get("fail_stores")) \
            and not capabilities.transfer_failures:
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
    for op in vector.ops:
        if (reason := _unsupported_op(op, capabilities)) is not None:
            raise Unsupported(f"{vector.name} needs {reason}")
    unset = [name for name in VARIANTS if name not in vector.config.model_fields_set]  # expectations hold for each
    adapter.start(vector.config.model_copy(update={name: getattr(capabilities, name)[0] for name in unset}))
    try:
        for number, op in enumerate(vector.ops):
            args = op.get("args", {})
            if op["op"] == "add_request":
                adapter.add_request(RequestSpec(**args))
            elif op["op"] == "step":
                observation = adapter.step().model_dump(mode="json")
                _expect(vector, number, observation, op.get("expect", {}), op.get("clauses", {}))
            else:
                getattr(adapter, op["op"])(**args)
    finally:
        adapter.close()


def _expect(vector: Vector, number: int, observation: dict[str, Any], expect: dict[str, Any],
            clauses: dict[str, str]) -> None:
    """Raise `ClauseViolation` with a diff of every expected field the step's observation does not match."""
    wrong = [name for name, wanted in expect.items() if observation[name] != _json(wanted)]
    if wrong:
        diff = "".join(f"\n  {name}:\n    - expected {_json(expect[name])!r}\n    + observed {observation[name]!r}"
                       for name in wrong)
        raise ClauseViolation(clauses.get(wrong[0], vector.clause), f"vector {vector.name}, op {number} (step): "
                                                                    f"expected vs observed{diff}")


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
    `looked_up=False` (no lookup).
    """

    config: EngineConfig
    level: SpecLevel = "offloading"
    clause: str = "SCENARIO"
    description: str = ""
    ops: list[dict[str, Any]] = field(default_factory=list)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1, **spec: Any) -> Scenario:
        args = RequestSpec(request_id=request_id, prompt=tuple(prompt), max_tokens=max_tokens, **spec)
        self.ops.append({"op": "add_request", "args": args.model_dump(mode="json", exclude_defaults=True)
                         | {"request_id": request_id, "prompt": list(prompt)}})
        return self

    def step(self, *, loaded: Any = None, stored: Any = None, flushed: Any = None, looked_up: bool | None = None,
             **expect: Any) -> Scenario:
        for name, pairs in (("completed_loads", loaded), ("completed_stores", stored), ("flushed_stores", flushed)):
            if pairs is not None:
                expect[name] = [self._job(name, *job) for job in pairs]
        if looked_up is False:
            expect["lookups"] = {}
        self.ops.append({"op": "step", "expect": _json(expect)} if expect else {"op": "step"})
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
