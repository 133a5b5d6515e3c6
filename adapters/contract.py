"""The adapter contract: the interface the harness drives (spec chapter `adapter-contract`).

An adapter wraps one implementation of a KV-cache manager plus offload connector. The values it takes and
returns are those of `kvconform.common.values`.
"""

from __future__ import annotations

import abc
from typing import Any

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


class ImplementationFailure(Exception):
    """Raised by an adapter when the implementation itself failed an operation in a way that breaks `clause`.

    The harness reports it under `clause` instead of CONF-CALL-1. With `recovered`, the implementation is
    still usable — as vLLM's engine core stays up after a failed utility call — and the operation's outcome
    is `result`; a run that lists `clause` as a known failure then goes on (CONF-RUN-2). A recovered failure of
    `reset_prefix_cache(True)` is one of the connector reset: the prefix cache reset took effect (`result` is its
    answer), the connector's did not, and the reference keeps its connector as well (OFF-MGR-8).
    """

    def __init__(self, clause: str, message: str, *, recovered: bool = False, result: object = None) -> None:
        super().__init__(message)
        self.clause = clause
        self.recovered = recovered
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle it whole, as an engine in another process sends it back (`vllm-pd` with two processes)."""
        return (type(self), (self.clause, str(self)), {"recovered": self.recovered, "result": self.result})


class KVConnectorAdapter(abc.ABC):
    """One implementation under test. The harness builds a fresh adapter per test case.

    An adapter of the disaggregated level (`Capabilities.levels` holds "disaggregated", chapter `disaggregated`)
    drives a pair of engines, a producer (prefill) and a consumer (decode), each with `EngineConfig.
    tensor_parallel_size` ranks, through this same interface:

    - `start(config)` builds both engines from one config, with distinct engine ids;
    - `prefill(request)` sends a request to the producer with `kv_transfer_params={"do_remote_decode": True}`, as
      a P/D proxy does; when it finishes, the step's `EngineStep.params` of the producer carry the params its
      `request_finished` returned;
    - `decode(request, prefill_id, params=None)` sends a request to the consumer with the params that prefill
      `prefill_id` returned, as a P/D proxy forwards them: the adapter keeps what its producer returned per request
      and forwards it with `kvconform.common.forwarding.forwarded_params`, each field of `params` replacing the
      returned one (a None value removes it: a malformed forward the harness asks for on purpose, PD-PARAMS-2);
    - `add_request(request)` sends a plain request, no params, to the consumer (it computes locally);
    - `step()` steps the producer, then the consumer, once each, and returns one `StepObservation`: its fields are the
      union of the two engines' (request ids are unique across the pair), and `disaggregated` holds each engine's
      connector facts (`EngineStep`: each rank's reports, the aggregated finished/failed ids, returned params, held
      blocks);
    - `abort`, `preempt` and `computed_kv` act on the engine that holds the request; `reset_prefix_cache` resets both
      and answers True if both did; `complete_transfers` completes the consumer's reads (a harness-clocked pair);
      `resource_usage` is the sum of both engines'; `store_contents` is empty (nothing is offloaded).

    A bad request the adapter refuses (a tensor-parallel size it does not run, say) is for `start` to raise as
    `ImplementationFailure` or `ValueError`; malformed params are the connector's to answer (PD-PARAMS-2).
    """

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

    def prefill(self, request: RequestSpec) -> None:
        """Disaggregated level: queue `request` on the producer, to be decoded remotely (`do_remote_decode`)."""
        raise NotImplementedError(f"{self.name} drives one engine, not a producer/consumer pair (levels)")

    def decode(self, request: RequestSpec, prefill_id: str, params: dict[str, Any] | None = None) -> None:
        """Disaggregated level: queue `request` on the consumer with the kv_transfer_params that prefill `prefill_id`
        returned when it finished (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`,
        ...), each field of `params` replacing the returned one, a None value removing it:
        `forwarded_params(returned, params)` (`kvconform.common.forwarding`), as a P/D proxy forwards them. The harness
        sends a decode only for a prefill whose params the pair's steps reported (`EngineStep.params`). `prefill_id` is
        also the proxy's own request, whose id a P/D proxy sends both engines (NIXL's push mode pairs a decode with its
        prefill by it), whatever the params say."""
        raise NotImplementedError(f"{self.name} drives one engine, not a producer/consumer pair (levels)")

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
