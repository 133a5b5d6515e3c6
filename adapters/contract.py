"""The adapter contract: the interface the harness drives (spec chapter `adapter-contract`).

An adapter wraps one implementation of a KV-cache manager plus offload connector. The values it takes and
returns are those of `kvconform.common.values`.
"""

from __future__ import annotations

import abc
import os

import torch

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

TENSOR_PARALLEL_VARIABLE = "KVCONFORM_TENSOR_PARALLEL_SIZE"
"""The tensor-parallel size a run asks an adapter for: ranks per engine, each with its share of the KV heads. Set by
`kvconform run --tensor-parallel-size` and pytest's `--kv-tensor-parallel-size` (`conformance.options`); unset is 1."""


def tensor_parallel_size() -> int:
    """Return the tensor-parallel size the run asks for, or raise ValueError saying what is wrong with it."""
    text = os.environ.get(TENSOR_PARALLEL_VARIABLE, "1").strip()
    if not (text.isdigit() and int(text) >= 1):
        raise ValueError(f"--tensor-parallel-size ({TENSOR_PARALLEL_VARIABLE}) must be a whole number of ranks, 1 or "
                         f"more, not {text!r}")
    return int(text)


class ImplementationFailure(Exception):
    """Raised by an adapter when the implementation itself failed an operation in a way that breaks `clause`.

    The harness reports it under `clause` instead of CONF-CALL-1. With `recovered`, the implementation is
    still usable — as vLLM's engine core stays up after a failed utility call — and the operation's outcome
    is `result`; a run that lists `clause` as a known failure then goes on (CONF-RUN-2).
    """

    def __init__(self, clause: str, message: str, *, recovered: bool = False, result: object = None) -> None:
        super().__init__(message)
        self.clause = clause
        self.recovered = recovered
        self.result = result


class KVConnectorAdapter(abc.ABC):
    """One implementation under test. The harness builds a fresh adapter per test case."""

    name: str = "unnamed"

    @abc.abstractmethod
    def implementation_version(self) -> str:
        """Return the version of the wrapped implementation."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Return what the implementation supports."""

    def behaviours(self) -> tuple[str, ...]:
        """Return the behaviours, among those its releases differ in, that the implementation was found to have, each
        `name: where the code shows it`; read from the code it drives or a probe, never from a version string. The
        report and the run's banner name them (CONF-CAP-1); the default finds none."""
        return ()

    @abc.abstractmethod
    def start(self, config: EngineConfig) -> None:
        """Build a fresh engine with this configuration."""

    @abc.abstractmethod
    def add_request(self, request: RequestSpec) -> None:
        """Queue a request (it is considered for scheduling at the next step)."""

    @abc.abstractmethod
    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        """Run one engine step: schedule, connector metadata, forward, worker transfers, output processing.

        With `complete_transfers` (only if `Capabilities.complete_in_step`), every transfer in flight when the worker
        polls its jobs — after the forward, the step's flushes and its stores' submission — finishes there, with
        that outcome, and is reported in this step."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort an unfinished request."""

    @abc.abstractmethod
    def preempt(self, request_id: str) -> None:
        """Preempt a running request now: its GPU blocks are released and it recomputes later."""

    @abc.abstractmethod
    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        """Reset the local prefix cache (and the offload store if asked); return the engine's answer."""

    @abc.abstractmethod
    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Let every in-flight transfer finish now, failing loads and/or stores; reported at the next step."""

    @abc.abstractmethod
    def store_contents(self) -> StoreSnapshot:
        """Return the offload store's contents."""

    @abc.abstractmethod
    def computed_kv(self, request_id: str) -> torch.Tensor:
        """Return the GPU KV rows `[num_computed_tokens, token_width]` of a running request, or of a waiting
        request whose load has completed (its computed tokens are its local hit plus the loaded ones)."""

    def stored_kv(self, block: BlockRef) -> torch.Tensor:
        """Return the KV rows `[offloaded block size, token_width]` the store holds for a readable offloaded block.

        Called only if `Capabilities.reads_stored_kv`, for the blocks a store completed in the step just observed made
        readable (XFER-DATA-3); an adapter that cannot read its store's bytes keeps the capability off."""
        raise NotImplementedError(f"{self.name} does not read its store's bytes (capabilities: reads_stored_kv=False)")

    @abc.abstractmethod
    def resource_usage(self) -> ResourceUsage:
        """Return the counters that must be zero when idle."""

    def close(self) -> None:  # noqa: B027 -- an optional hook: an adapter with nothing to release keeps the no-op
        """Release resources; the default does nothing."""
