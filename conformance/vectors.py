"""Trace vectors: fixed operation sequences with the observations the spec requires of them.

A vector is JSON: `config` (EngineConfig fields), and `ops`, each `{"op": name, "args": {...}}`. A `step`
op may carry `expect`, a subset of `StepObservation` fields that must match exactly, and `clauses`,
the clause each expected field enforces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvconform.adapters.contract import VARIANTS, EngineConfig, KVConnectorAdapter, RequestSpec
from kvconform.conformance.checks import ClauseViolation


@dataclass(frozen=True)
class Vector:
    name: str
    description: str
    config: EngineConfig
    ops: tuple[dict[str, Any], ...]


def load(name: str) -> Vector:
    """Return the bundled vector `name` (a file `vectors/<name>.json`)."""
    data = json.loads(resources.files(__package__).joinpath("vectors", f"{name}.json").read_text())
    return Vector(name, data["description"], EngineConfig(**data["config"]), tuple(data["ops"]))


def bundled() -> list[str]:
    """Return the names of the bundled vectors."""
    folder = resources.files(__package__).joinpath("vectors")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def replay(vector: Vector, adapter: KVConnectorAdapter) -> None:
    """Run the vector's operations on `adapter`; raise `ClauseViolation` at the first unmet expectation."""
    capabilities = adapter.capabilities()
    unset = [name for name in VARIANTS if name not in vector.config.model_fields_set]  # expectations hold for each
    adapter.start(vector.config.model_copy(update={name: getattr(capabilities, name)[0] for name in unset}))
    try:
        for number, op in enumerate(vector.ops):
            args = op.get("args", {})
            if op["op"] == "add_request":
                adapter.add_request(RequestSpec(**args))
            elif op["op"] == "step":
                observation = adapter.step().model_dump(mode="json")
                _expect(vector.name, number, observation, op.get("expect", {}), op.get("clauses", {}))
            else:
                getattr(adapter, op["op"])(**args)
    finally:
        adapter.close()


def _expect(vector: str, number: int, observation: dict[str, Any], expect: dict[str, Any],
            clauses: dict[str, str]) -> None:
    for field, wanted in expect.items():
        if observation[field] != wanted:
            raise ClauseViolation(clauses[field], f"vector {vector}, op {number}: {field} = {observation[field]!r}, "
                                                  f"expected {wanted!r}")
