"""The reference adapter: the reference engine behind the adapter contract."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.values import (
    BlockRef,
    Capabilities,
    EngineConfig,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreSnapshot,
    TransferOutcome,
)
from kvconform.common.version import KIT_VERSION
from kvconform.reference.engine import Engine, StepResult
from kvconform.reference.observation import Observer


class ReferenceAdapter(KVConnectorAdapter):
    """Drives `kvconform.reference.engine.Engine` by its own scheduling policy; supports every capability."""

    name = "reference"

    def __init__(self, device: torch.device | None = None, *,
                 engine: Callable[[EngineConfig, torch.device | None], Engine] = Engine) -> None:
        """`engine` builds the engine that each `start` runs: the reference `Engine`, or one a mutant assembles."""
        self.device = device
        self.build_engine = engine
        self._engine: Engine | None = None
        self._observer: Observer | None = None

    @property
    def engine(self) -> Engine:
        """Return the engine the last `start` built."""
        if self._engine is None:
            raise RuntimeError(f"{self.name} has no engine before start(config)")
        return self._engine

    @property
    def observer(self) -> Observer:
        """Return the observer of the engine the last `start` built."""
        if self._observer is None:
            raise RuntimeError(f"{self.name} has no engine to observe before start(config)")
        return self._observer

    def implementation_version(self) -> str:
        return KIT_VERSION

    def capabilities(self) -> Capabilities:
        return Capabilities(complete_in_step=True, reads_stored_kv=True, levels=("connector", "offloading", "events"))

    def start(self, config: EngineConfig) -> None:
        self._engine = self.build_engine(config, self.device)
        self._observer = Observer(self._engine)

    def add_request(self, request: RequestSpec) -> None:
        self.engine.add_request(request)

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        outcome = (None if complete_transfers is None
                   else (complete_transfers.fail_loads, complete_transfers.fail_stores))
        return self.observe(self.engine.step(outcome))

    def observe(self, result: StepResult) -> StepObservation:
        """Return what a step of the engine observed (`reference.observation`)."""
        return self.observer.step(result)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def preempt(self, request_id: str) -> None:
        self.engine.preempt(request_id)

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        return self.engine.reset_prefix_cache(reset_connector)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        self.engine.complete_transfers(fail_loads, fail_stores)

    def store_contents(self) -> StoreSnapshot:
        return self.observer.store_contents()

    def computed_kv(self, request_id: str) -> torch.Tensor:
        return self.engine.computed_kv(request_id)

    def stored_kv(self, block: BlockRef) -> torch.Tensor:
        return self.engine.stored_kv(block.request_id, block.index)

    def resource_usage(self) -> ResourceUsage:
        return self.observer.resource_usage()
