"""An exact, in-process reference pair of P/D connectors: a producer (prefill) and a consumer (decode) engine's
connectors, no network (chapter `disaggregated`).

The pair follows vLLM's public P/D contract as NixlConnector 0.34 implements it, on `kv_transfer_params`:
a producer request carries `do_remote_decode`; when it finishes the producer delays the free of its blocks and
returns the params a consumer needs (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`,
`remote_block_ids`, `tp_size`). The consumer answers the whole prompt as one asynchronous load, reads the
producer's blocks and notifies it; the producer frees its blocks on the notification or when the lease ends.

Each engine has `world_size` ranks (tensor parallelism): rank r holds and moves only its share of the KV
heads, the columns `heads(r)` of a token's KV row, and reports its own finished ids; the engine sees a request
finished only once every rank reported it, as vLLM's `KVOutputAggregator` counts (`Aggregator`). The consumer's
rank r reports its reads r steps after rank 0, as ranks on their own threads do, so that the count matters. Time is the
producer's steps, so the pair is deterministic: transfers complete when the harness completes them.

Each connector sits in a reference engine's connector seam (`engine.ConnectorScheduler`, `engine.ConnectorWorker`)
as one side of the pair, scheduler and worker side in one: `ProducerSide` and `ConsumerSide`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from kvconform.common.forwarding import valid_params
from kvconform.reference.connector import ConnectorUpdate, KnownDeviations, SchedulerOutput
from kvconform.reference.errors import InvalidCall
from kvconform.reference.request import Request, RequestStatus
from kvconform.reference.transfer import TransferEngine

LEASE_STEPS = 8
"""Producer steps a delayed free waits for the consumer's notification before the lease ends it: short enough that a
drain (`execution.DRAIN_STEP_LIMIT` steps) outlasts the holds of the most requests a program keeps live, one after
another where the pool holds one at a time."""


@dataclass
class RankOutput:
    """One rank's report of a step, as a worker's `KVConnectorOutput` carries it."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class Aggregator:
    """Counts each id down per rank and emits it once every rank reported it (vLLM's `KVOutputAggregator`)."""

    world_size: int
    remaining: dict[tuple[str, str], int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def aggregate(self, outputs: Sequence[RankOutput]) -> RankOutput:
        """Return the ids every rank has now reported; a failed receive is carried until its receive completes."""
        if len(outputs) != self.world_size:
            raise InvalidCall("PD-TP-1", f"{len(outputs)} rank outputs for a world of {self.world_size}")
        done = RankOutput()
        for output in outputs:
            self.failed |= output.failed_recving
            for kind, ids in (("sending", output.finished_sending), ("recving", output.finished_recving)):
                for request_id in sorted(ids):
                    left = self.remaining.get((kind, request_id), self.world_size) - 1
                    self.remaining[(kind, request_id)] = left
                    if left == 0:
                        del self.remaining[(kind, request_id)]
                        (done.finished_sending if kind == "sending" else done.finished_recving).add(request_id)
        done.failed_recving = done.finished_recving & self.failed
        self.failed -= done.finished_recving
        return done


def heads(rank: int, world_size: int, token_width: int) -> slice:
    """Return the columns of a token's KV row that rank `rank` holds: its share of the heads (PD-TP-1)."""
    if token_width % world_size:
        raise InvalidCall("PD-TP-1", f"token width {token_width} does not split over {world_size} ranks")
    share = token_width // world_size
    return slice(rank * share, (rank + 1) * share)


@dataclass
class Transport:
    """The in-process medium between engines: producers by engine id, and each producer's pending notifications."""

    producers: dict[str, ProducerConnector] = field(default_factory=dict)
    notifications: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """Producer engine id -> (producer request id, consumer rank) read notifications not yet taken."""

    def register(self, producer: ProducerConnector) -> None:
        if producer.engine_id in self.producers:
            raise InvalidCall("PD-PARAMS-1", f"engine id {producer.engine_id!r} is already registered")
        self.producers[producer.engine_id] = producer
        self.notifications[producer.engine_id] = []


@dataclass
class Held:
    """A finished producer request whose blocks wait for the consumer's read (PD-HOLD-1)."""

    block_ids: list[int]
    expires: int
    notified: set[int] = field(default_factory=set)
    """Consumer ranks that notified their read."""
    reported: set[int] = field(default_factory=set)
    """Producer ranks that reported the hold ended: each reports it once (PD-TP-1)."""


class ProducerConnector:
    """The prefill engine's connector: holds a finished request's blocks until every rank's read or the lease."""

    def __init__(self, engine_id: str, gpu: torch.Tensor, world_size: int, transport: Transport,
                 lease_steps: int = LEASE_STEPS) -> None:
        self.engine_id, self.gpu, self.world_size = engine_id, gpu, world_size
        self.transport, self.lease_steps = transport, lease_steps
        self.clock = 0
        self.held: dict[str, Held] = {}
        self.aggregator = Aggregator(world_size)
        self.rank_outputs: list[RankOutput] = []
        """Each rank's report of the latest step, before aggregation."""
        transport.register(self)

    def request_finished(self, request_id: str, block_ids: list[int], params: dict[str, Any] | None,
                         finished_normally: bool) -> tuple[bool, dict[str, Any] | None]:
        """Return (delay_free, params for the consumer): only a request to be decoded remotely that finished normally
        holds its blocks; an aborted one frees them at once (PD-PARAMS-1, PD-ABORT-1)."""
        if not params or not params.get("do_remote_decode") or not finished_normally or not block_ids:
            return False, None
        self.held[request_id] = Held(list(block_ids), self.clock + self.lease_steps)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_request_id": request_id, "remote_block_ids": list(block_ids),
                      "tp_size": self.world_size}

    def step(self) -> RankOutput:
        """Advance the lease clock; each rank reports the requests its consumer rank read, or whose lease ended;
        return what every rank has reported (PD-HOLD-1, PD-LEASE-1, PD-TP-1)."""
        self.clock += 1
        for request_id, rank in self.transport.notifications[self.engine_id]:
            if request_id in self.held:  # a notification for a request no longer held is ignored (PD-NOTIFY-1)
                self.held[request_id].notified.add(rank % self.world_size)
        self.transport.notifications[self.engine_id] = []
        outputs = [RankOutput() for _ in range(self.world_size)]
        for request_id, held in list(self.held.items()):
            expired = self.clock >= held.expires
            for rank, output in enumerate(outputs):
                if (expired or rank in held.notified) and rank not in held.reported:
                    held.reported.add(rank)
                    output.finished_sending.add(request_id)
            if expired or len(held.notified) == self.world_size:
                del self.held[request_id]
        self.rank_outputs = outputs
        return self.aggregator.aggregate(outputs)

    def read(self, request_id: str, block_ids: Sequence[int], columns: slice) -> torch.Tensor | None:
        """Return the rows of held blocks `block_ids`, only `columns`; None if the request is not held or the blocks
        are not its own (a lease that ended, wrong remote block ids: PD-FAIL-1)."""
        held = self.held.get(request_id)
        if held is None or any(block not in held.block_ids for block in block_ids):
            return None
        return self.gpu[list(block_ids), :, columns].clone()


@dataclass
class Load:
    """A consumer request's pending read of the producer's blocks into its own."""

    params: dict[str, Any]
    local_block_ids: list[int]
    remote_block_ids: list[int]


class ConsumerConnector:
    """The decode engine's connector: answers a remote prefill as one asynchronous load; each rank reads its heads."""

    def __init__(self, gpu: torch.Tensor, world_size: int, transport: Transport) -> None:
        self.gpu, self.world_size, self.transport = gpu, world_size, transport
        self.pending: dict[str, Load] = {}
        self.in_flight: dict[str, Load] = {}
        self.completed: list[RankOutput] = [RankOutput() for _ in range(world_size)]
        self.lagging: list[list[RankOutput]] = [[RankOutput() for _ in range(rank)] for rank in range(world_size)]
        """Per rank, the reports it has made and not yet delivered: rank r's reach `get_finished` r calls late."""
        self.aggregator = Aggregator(world_size)
        self.rank_outputs: list[RankOutput] = []
        """Each rank's report delivered by the latest `get_finished`, before aggregation."""

    def get_num_new_matched_tokens(self, num_prompt_tokens: int, num_local: int, params: dict[str, Any] | None
                                   ) -> tuple[int, bool]:
        """Answer the prompt beyond the local hit as one asynchronous load; malformed or missing params get no load
        and the request computes locally (PD-LOAD-1, PD-PARAMS-2)."""
        count = num_prompt_tokens - num_local
        return (count, True) if valid_params(params) and count > 0 else (0, False)

    def update_state_after_alloc(self, request_id: str, block_ids: list[int], num_local_blocks: int,
                                 params: dict[str, Any]) -> None:
        """Plan the read of the remote blocks past the local hit into the request's blocks (PD-LOAD-1)."""
        remote = list(params["remote_block_ids"])[num_local_blocks:]
        local = block_ids[num_local_blocks: num_local_blocks + len(remote)]
        self.pending[request_id] = Load(params, local, remote)

    def start_load_kv(self) -> None:
        """Start the reads planned since the last step: they complete when `complete_transfers` is called."""
        self.in_flight.update(self.pending)
        self.pending = {}

    def read_columns(self, rank: int) -> slice:
        """Return the columns of the producer's KV rows that rank `rank` reads: its own heads (PD-TP-1)."""
        return heads(rank, self.world_size, self.gpu.shape[2])

    def complete_transfers(self, fail: bool) -> None:
        """Complete every read in flight: each rank copies its own heads and notifies the producer; a read of an
        unknown engine, of blocks not held, or one failed on purpose — in transit on rank 0, the ranks after it
        completing theirs — is reported failed (PD-FAIL-1, PD-TP-1)."""
        for request_id, load in sorted(self.in_flight.items()):
            producer = self.transport.producers.get(load.params["remote_engine_id"])
            for rank, output in enumerate(self.completed):
                rows = None if producer is None or (fail and rank == 0) else producer.read(
                    load.params["remote_request_id"], load.remote_block_ids, self.read_columns(rank))
                if producer is None or rows is None:
                    output.failed_recving.add(request_id)
                else:
                    self.gpu[load.local_block_ids, :, heads(rank, self.world_size, self.gpu.shape[2])] = rows
                    self.transport.notifications[producer.engine_id].append((load.params["remote_request_id"], rank))
                output.finished_recving.add(request_id)
        self.in_flight = {}

    def get_finished(self) -> RankOutput:
        """Return the receives every rank has reported since the last call, rank r's delivered r calls late
        (PD-ONCE-1, PD-TP-1)."""
        for rank, output in enumerate(self.completed):
            self.lagging[rank].append(output)
        self.completed = [RankOutput() for _ in range(self.world_size)]
        self.rank_outputs = [reports.pop(0) for reports in self.lagging]
        return self.aggregator.aggregate(self.rank_outputs)

    def reports_pending(self) -> bool:
        """Return True while a rank has a report not yet delivered."""
        return any(output.finished_recving or output.failed_recving
                   for reports in (self.completed, *self.lagging) for output in reports)

    def abort(self, request_id: str) -> None:
        """Drop a planned read that has not started; one in flight still completes and is reported (PD-ABORT-1)."""
        self.pending.pop(request_id, None)


# --- each connector in a reference engine's connector seam ------------------------------------------------------


@dataclass
class PairOutput:
    """What a side's worker reported in one step: the aggregated ids, and each rank's report (PD-TP-1)."""

    done: RankOutput = field(default_factory=RankOutput)
    ranks: list[RankOutput] = field(default_factory=list)


Connector = TypeVar("Connector", "ProducerConnector", "ConsumerConnector")


class PairSide(ABC, Generic[Connector]):
    """One engine's P/D connector in the reference engine's connector seam, scheduler and worker side in one: what
    both sides do alike. Built before its engine, it is the engine's scheduler side (`scheduler`) and, once the
    engine hands it its GPU (`attach`), builds its connector there and is its worker side."""

    connector: Connector

    def __init__(self, build: Callable[[torch.Tensor], Connector], block_size: int) -> None:
        self.build: Callable[[torch.Tensor], Connector] = build
        self.block_size = block_size
        self.params: dict[str, dict[str, Any] | None] = {}
        """Each request's kv_transfer_params, as it was sent."""
        self.returned: dict[str, dict[str, Any] | None] = {}
        """Requests that finished in the latest step -> the params request_finished returned."""
        self.output = PairOutput()
        """What the worker reported in the latest step."""
        self.blocks_of: Callable[[str], list[int]] = lambda request_id: []
        """The engine's block table, set once the engine is built."""

    def scheduler(self, *parts: object) -> PairSide[Connector]:
        """Return the side as its engine's scheduler side (the engine's `connector` factory)."""
        return self

    def attach(self, transfer: TransferEngine, defer_stores: bool) -> PairSide[Connector]:
        """Build the side's connector on the engine's GPU and return the side as its worker (the engine's `worker`
        factory)."""
        self.connector = self.build(transfer.gpu)
        return self

    @abstractmethod
    def request_finished(self, request: Request) -> bool:
        """Return True to delay freeing the request's GPU blocks: it is held for, or still being read by, the other
        engine."""

    @abstractmethod
    def finished(self) -> RankOutput:
        """Return the transfers every rank has now reported (PD-TP-1)."""

    def get_finished(self) -> PairOutput:
        """Return what every rank reported in the step, aggregated and each rank's own (PD-TP-1)."""
        self.output = PairOutput(self.finished(), list(self.connector.rank_outputs))
        return self.output

    # --- the scheduler side, alike for both ----------------------------------------------------------------

    @property
    def jobs(self) -> Collection[object]:
        """Return the transfers the engine waits for: none, but a consumer's reads."""
        return ()

    @property
    def key_origin(self) -> Mapping[bytes, tuple[str, int]]:
        """Return no key: nothing is offloaded."""
        return {}

    def on_new_request(self, request: Request) -> None:
        """Nothing to set up: the params were given with the request."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   deviations: KnownDeviations) -> tuple[int | None, bool]:
        """Answer nothing: only a consumer loads (PD-LOAD-1)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Nothing to plan: only a consumer loads."""

    def build_connector_meta(self, output: SchedulerOutput, deviations: KnownDeviations) -> None:
        """No metadata: the pair's transfers are started and reported by its connectors."""

    def update_connector_output(self, output: PairOutput) -> ConnectorUpdate:
        """Translate the worker's report: finished sends release holds (PD-HOLD-1)."""
        return ConnectorUpdate(released=set(output.done.finished_sending))

    def reset_cache(self) -> None:
        """Nothing is offloaded: nothing to reset."""

    def offload_keys(self, request: Request) -> list[bytes]:
        return []

    def take_events(self) -> list[dict]:
        """Nothing is offloaded: no connector events (chapter `kv-events`)."""
        return []

    # --- the worker side, alike for both ---------------------------------------------------------------------

    def start_load_kv(self, meta: object) -> None:
        """The reads started when the scheduler side built the step's metadata."""

    def store_sources_in_flight(self) -> set[int]:
        return set()

    def wait_for_save(self, meta: object) -> None:
        """A producer saves nothing: the consumer reads its blocks."""

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Nothing in flight: only a consumer reads."""


class ProducerSide(PairSide[ProducerConnector]):
    """The producer's side: delays a normally finished remote-decode request's free and returns its params."""

    def request_finished(self, request: Request) -> bool:
        """Delay a normally finished remote-decode request's free and return its params (PD-PARAMS-1, PD-ABORT-1)."""
        request_id = request.request_id
        delay, params = self.connector.request_finished(request_id, list(self.blocks_of(request_id)),
                                                        self.params.get(request_id),
                                                        request.status is RequestStatus.FINISHED)
        self.returned[request_id] = params
        return delay

    def finished(self) -> RankOutput:
        """Advance the lease clock; return the holds every rank ended (PD-HOLD-1, PD-TP-1)."""
        return self.connector.step()


class ConsumerSide(PairSide[ConsumerConnector]):
    """The consumer's side: answers a remote prefill as one asynchronous load, which the harness completes, each rank
    copying its heads."""

    def __init__(self, build: Callable[[torch.Tensor], ConsumerConnector], block_size: int) -> None:
        super().__init__(build, block_size)
        self.local_hits: dict[str, int] = {}
        self.delayed: set[str] = set()
        """Requests finished while their read was in flight: freed once it is reported (PD-ABORT-1)."""

    @property
    def jobs(self) -> Collection[object]:
        """Return the reads planned, in flight or not yet reported by every rank: what the engine waits for."""
        connector = self.connector
        return ("reads",) if connector.pending or connector.in_flight or connector.reports_pending() else ()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   deviations: KnownDeviations) -> tuple[int | None, bool]:
        """Answer a remote prefill past the local hit; a request without valid params, nothing (PD-LOAD-1,
        PD-PARAMS-2)."""
        self.local_hits[request.request_id] = num_computed_tokens
        return self.connector.get_num_new_matched_tokens(len(request.prompt), num_computed_tokens,
                                                         self.params.get(request.request_id))

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the read of the remote blocks; the params are spent, as vLLM NIXL clears `do_remote_prefill`."""
        params = self.params.get(request.request_id)
        if num_external_tokens and params is not None:
            num_local_blocks = self.local_hits[request.request_id] // self.block_size
            self.connector.update_state_after_alloc(request.request_id, list(block_ids), num_local_blocks, params)
            self.params[request.request_id] = {**params, "do_remote_prefill": False}

    def build_connector_meta(self, output: SchedulerOutput, deviations: KnownDeviations) -> None:
        """Start the reads planned in this step (the worker's start_load_kv)."""
        self.connector.start_load_kv()

    def request_finished(self, request: Request) -> bool:
        """Delay the free of a request whose read is in flight until it is reported (PD-ABORT-1)."""
        request_id = request.request_id
        self.returned[request_id] = None
        self.connector.abort(request_id)
        if request_id in self.connector.in_flight or self.reading(request_id):
            self.delayed.add(request_id)
            return True
        return False

    def reading(self, request_id: str) -> bool:
        """Return True while a rank has a read of the request not yet reported."""
        return any(request_id in output.finished_recving
                   for output in (*self.connector.completed, *(o for q in self.connector.lagging for o in q)))

    def update_connector_output(self, output: PairOutput) -> ConnectorUpdate:
        """Finished receives end loads, and free the requests that finished meanwhile (PD-ONCE-1, PD-ABORT-1)."""
        update = super().update_connector_output(output)
        for request_id in output.done.finished_recving:
            update.loads_done[request_id] = request_id not in output.done.failed_recving
            if request_id in self.delayed:
                self.delayed.discard(request_id)
                update.released.add(request_id)
        return update

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Complete the reads in flight, failed with `fail_loads` (PD-FAIL-1)."""
        self.connector.complete_transfers(fail_loads)

    def finished(self) -> RankOutput:
        """Return the receives every rank reported (PD-ONCE-1, PD-TP-1)."""
        return self.connector.get_finished()
