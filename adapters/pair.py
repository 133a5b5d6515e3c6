"""What every adapter of a producer/consumer pair does alike, whatever its engines (chapter `disaggregated`): a call
on a request goes to the engine that holds it, a reset to both, usage is their sum, and a step of the pair is the
union of both engines' steps. Neither pair adapter is built on the other: both are built on this."""

from __future__ import annotations

from typing import Any, cast

import torch

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.values import DisaggregatedStep, ResourceUsage, StepObservation, StoreSnapshot


class EnginePair(KVConnectorAdapter):
    """The adapter contract's pair: two engines, "producer" and "consumer", each with `requests`, `abort`, `preempt`,
    `reset_prefix_cache`, `computed_kv` and `resource_usage`."""

    engines: dict[str, Any]

    def engine_of(self, request_id: str) -> Any:
        """Return the engine that holds a request."""
        for engine in self.engines.values():
            if request_id in engine.requests:
                return engine
        raise KeyError(f"unknown request id {request_id!r}: neither engine of the pair holds it")

    def engine_usage(self, role: str) -> ResourceUsage:
        """Return one engine's counters."""
        return cast(ResourceUsage, self.engines[role].resource_usage())

    def abort(self, request_id: str) -> None:
        self.engine_of(request_id).abort(request_id)

    def preempt(self, request_id: str) -> None:
        self.engine_of(request_id).preempt(request_id)

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        answers = [engine.reset_prefix_cache(reset_connector) for engine in self.engines.values()]
        return all(answers)

    def store_contents(self) -> StoreSnapshot:
        return StoreSnapshot(ready=frozenset(), storing=frozenset())

    def computed_kv(self, request_id: str) -> torch.Tensor:
        return cast(torch.Tensor, self.engine_of(request_id).computed_kv(request_id))

    def resource_usage(self) -> ResourceUsage:
        usages = [self.engine_usage(role) for role in self.engines]
        return ResourceUsage(**{name: sum(getattr(usage, name) for usage in usages)
                                for name in ResourceUsage.model_fields})


def merge(observations: list[StepObservation], pair: DisaggregatedStep) -> StepObservation:
    """Return the pair's step: the union of both engines' observations (request ids are unique across them), physical
    blocks left to each engine's `EngineStep`, and each engine's connector facts."""
    fields: dict[str, Any] = {}
    for name in StepObservation.model_fields:
        values = [getattr(observation, name) for observation in observations]
        if name in ("forward_writes", "store_reads_in_flight"):
            fields[name] = frozenset()
        elif name == "disaggregated":
            fields[name] = pair
        elif isinstance(values[0], dict):
            fields[name] = {key: value for each in values for key, value in each.items()}
        else:
            fields[name] = tuple(item for each in values for item in each)
    return StepObservation.model_construct(**fields)
