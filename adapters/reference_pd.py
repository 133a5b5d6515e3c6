"""The reference P/D adapter: two reference engines, a producer and a consumer, joined by the reference pair of P/D
connectors (`reference.disaggregated`), behind the adapter contract of the disaggregated level (chapter
`disaggregated`).

Each engine is the reference `Engine` with a `PairSide` in place of its offload connector, scheduler and worker side
in one: the producer's side delays a finished request's free and returns its params; the consumer's answers a remote
prefill as one asynchronous load, which the harness completes (`complete_transfers`), each rank copying its heads.
Time is the producer's steps (`LEASE_STEPS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

import kvconform
from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.forwarding import forwarded_params
from kvconform.common.values import (
    Capabilities,
    DisaggregatedStep,
    EngineConfig,
    EngineStep,
    RankReport,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreSnapshot,
    TransferOutcome,
)
from kvconform.reference.connector import ConnectorUpdate, SchedulerOutput
from kvconform.reference.disaggregated import (
    LEASE_STEPS,
    ConsumerConnector,
    ProducerConnector,
    RankOutput,
    Transport,
)
from kvconform.reference.engine import Engine, StepResult
from kvconform.reference.errors import InvalidCall
from kvconform.reference.observation import Observer
from kvconform.reference.request import Request, RequestStatus

PRODUCER_ID = "prefill-0"
"""The producer's engine id, which its params name (`remote_engine_id`)."""

TENSOR_PARALLEL_SIZES = (1, 2, 4)
"""Ranks per engine the reference pair runs: each divides the default token width (8)."""


@dataclass
class PairOutput:
    """What a side's worker reported in one step: the aggregated ids, and each rank's report (PD-TP-1)."""

    done: RankOutput = field(default_factory=RankOutput)
    ranks: list[RankOutput] = field(default_factory=list)


class PairSide:
    """One engine's P/D connector, scheduler and worker side in one, in the reference engine's connector seam."""

    def __init__(self, connector: ProducerConnector | ConsumerConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self.params: dict[str, dict[str, Any] | None] = {}
        """Each request's kv_transfer_params, as it was sent."""
        self.local_hits: dict[str, int] = {}
        self.delayed: set[str] = set()
        """Consumer requests finished while their read was in flight: freed once it is reported (PD-ABORT-1)."""
        self.returned: dict[str, dict[str, Any] | None] = {}
        """Requests that finished in the latest step -> the params request_finished returned."""
        self.output = PairOutput()
        """What the worker reported in the latest step."""
        self.jobs: list[str] = []
        self.key_origin: dict[bytes, tuple[str, int]] = {}
        self.engine_blocks: Callable[[str], list[int]] = lambda request_id: []
        """The engine's block table, set once the engine is built."""

    # --- the scheduler side -------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Nothing to set up: the params were given with the request."""

    def get_num_new_matched_tokens(self, request: Request, num_local: int, deviations: object) -> tuple[int, bool]:
        """The consumer answers a remote prefill past the local hit; the producer, and a request without params,
        nothing (PD-LOAD-1, PD-PARAMS-2)."""
        if not isinstance(self.connector, ConsumerConnector):
            return 0, False
        self.local_hits[request.request_id] = num_local
        return self.connector.get_num_new_matched_tokens(len(request.prompt), num_local,
                                                         self.params.get(request.request_id))

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external: int) -> None:
        """Plan the read of the remote blocks; the params are spent, as vLLM NIXL clears `do_remote_prefill`."""
        params = self.params.get(request.request_id)
        if num_external and isinstance(self.connector, ConsumerConnector) and params is not None:
            num_local_blocks = self.local_hits[request.request_id] // self.block_size
            self.connector.update_state_after_alloc(request.request_id, list(block_ids), num_local_blocks, params)
            self.params[request.request_id] = {**params, "do_remote_prefill": False}
            self.sync_jobs()

    def build_connector_meta(self, output: SchedulerOutput, deviations: object) -> None:
        """Start the reads planned in this step (the worker's start_load_kv)."""
        if isinstance(self.connector, ConsumerConnector):
            self.connector.start_load_kv()

    def request_finished(self, request: Request) -> bool:
        """The producer delays a normally finished remote-decode request's free and returns its params; the consumer
        delays the free of a request whose read is in flight until it is reported (PD-PARAMS-1, PD-ABORT-1)."""
        request_id = request.request_id
        if isinstance(self.connector, ProducerConnector):
            blocks = list(self.engine_blocks(request_id))
            delay, params = self.connector.request_finished(request_id, blocks, self.params.get(request_id),
                                                            request.status is RequestStatus.FINISHED)
            self.returned[request_id] = params
            return delay
        self.returned[request_id] = None
        self.connector.abort(request_id)
        if request_id in self.connector.in_flight or self.reading(request_id):
            self.delayed.add(request_id)
            return True
        self.sync_jobs()
        return False

    def reading(self, request_id: str) -> bool:
        """Return True while a consumer rank has a read of the request not yet reported."""
        assert isinstance(self.connector, ConsumerConnector)
        return any(request_id in output.finished_recving
                   for output in (*self.connector.completed, *(o for q in self.connector.lagging for o in q)))

    def update_connector_output(self, output: PairOutput) -> ConnectorUpdate:
        """Translate the worker's report: finished sends release holds; finished receives end loads, and free the
        consumer requests that finished meanwhile."""
        update = ConnectorUpdate()
        update.released = set(output.done.finished_sending)
        for request_id in output.done.finished_recving:
            update.loads_done[request_id] = request_id not in output.done.failed_recving
            if request_id in self.delayed:
                self.delayed.discard(request_id)
                update.released.add(request_id)
        self.sync_jobs()
        return update

    def reset_cache(self) -> None:
        """Nothing is offloaded: nothing to reset."""

    def offload_keys(self, request: Request) -> list[bytes]:
        return []

    def sync_jobs(self) -> None:
        """Keep `jobs` (what the engine waits for) the reads planned, in flight or not yet reported by every rank."""
        connector = self.connector
        if isinstance(connector, ConsumerConnector):
            busy = bool(connector.pending or connector.in_flight or connector.reports_pending())
            self.jobs = ["reads"] if busy else []

    # --- the worker side ---------------------------------------------------------------------------------

    def start_load_kv(self, meta: object) -> None:
        """The reads started when the scheduler side built the step's metadata."""

    def store_sources_in_flight(self) -> set[int]:
        return set()

    def wait_for_save(self, meta: object) -> None:
        """A producer saves nothing: the consumer reads its blocks."""

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Complete the consumer's reads in flight, failed with `fail_loads` (PD-FAIL-1)."""
        if isinstance(self.connector, ConsumerConnector):
            self.connector.complete_transfers(fail_loads)
            self.sync_jobs()

    def get_finished(self) -> PairOutput:
        """Return what every rank reported: the producer's ended holds (its step advances the lease clock), the
        consumer's receives (PD-TP-1)."""
        done = self.connector.step() if isinstance(self.connector, ProducerConnector) else self.connector.get_finished()
        self.output = PairOutput(done, list(self.connector.rank_outputs))
        self.sync_jobs()
        return self.output


class EnginePair(KVConnectorAdapter):
    """What an adapter of a producer/consumer pair does alike for any engines: a call on a request goes to the engine
    that holds it, a reset to both, usage is their sum (the adapter contract's pair)."""

    engines: dict[str, Any]
    """"producer" and "consumer": engines with `requests`, `abort`, `preempt`, `reset_prefix_cache`, `computed_kv`."""

    def engine_of(self, request_id: str) -> Any:
        """Return the engine that holds a request."""
        for engine in self.engines.values():
            if request_id in engine.requests:
                return engine
        raise InvalidCall("CONF-OBS-2", f"unknown request id {request_id!r}")

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


class ReferencePDAdapter(EnginePair):
    """Drives a producer and a consumer reference engine by their own scheduling policy (chapter `disaggregated`)."""

    name = "reference-pd"

    def __init__(self, *, producer: Callable[..., ProducerConnector] = ProducerConnector,
                 consumer: Callable[..., ConsumerConnector] = ConsumerConnector) -> None:
        """`producer` and `consumer` build the pair's connectors: the reference's, or a mutant's."""
        self.build_producer, self.build_consumer = producer, consumer
        self.engines: dict[str, Engine] = {}
        self.sides: dict[str, PairSide] = {}
        self.observers: dict[str, Observer] = {}
        self.returned: dict[str, dict[str, Any] | None] = {}
        """The producer's finished requests -> the params their `request_finished` returned, for `decode` to forward."""

    def implementation_version(self) -> str:
        return kvconform.__version__

    def capabilities(self) -> Capabilities:
        return Capabilities(levels=("disaggregated",), complete_in_step=True, block_size_factors=(1,),
                            eviction_policies=("lru",), tensor_parallel_sizes=TENSOR_PARALLEL_SIZES,
                            lease_steps=LEASE_STEPS)

    def start(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        if size not in TENSOR_PARALLEL_SIZES or config.token_width % size:
            raise ValueError(f"the reference pair runs tensor_parallel_size {TENSOR_PARALLEL_SIZES} dividing the token "
                             f"width {config.token_width}, not {size}")
        transport = Transport()
        for role in ("producer", "consumer"):
            def build_side(transfer: Any, defer_stores: bool, role: str = role) -> PairSide:
                connector = (self.build_producer(PRODUCER_ID, transfer.gpu, size, transport) if role == "producer"
                             else self.build_consumer(transfer.gpu, size, transport))
                return PairSide(connector, config.block_size)

            # the engine builds its connector before its worker, and a side needs the worker's GPU tensor: the side
            # is built as the worker, then put in the connector's place too
            engine = Engine(config, connector=cast(Any, lambda manager, cfg, recorder: None),
                            worker=cast(Any, build_side))
            side = cast(PairSide, engine.worker)
            engine.connector = cast(Any, side)
            side.engine_blocks = engine.kv.blocks_of
            self.engines[role], self.sides[role], self.observers[role] = engine, side, Observer(engine)

    def engine_usage(self, role: str) -> ResourceUsage:
        return self.observers[role].resource_usage()

    def _add(self, role: str, request: RequestSpec, params: dict[str, Any] | None) -> None:
        if any(request.request_id in engine.requests for engine in self.engines.values()):
            raise InvalidCall("LIFE-ADD-1", f"request id {request.request_id!r} was already used in the pair")
        self.sides[role].params[request.request_id] = params
        self.engines[role].add_request(request)

    def add_request(self, request: RequestSpec) -> None:
        self._add("consumer", request, None)

    def prefill(self, request: RequestSpec) -> None:
        self._add("producer", request, {"do_remote_decode": True})

    def decode(self, request: RequestSpec, prefill_id: str, params: dict[str, Any] | None = None) -> None:
        """Forward what the producer returned for `prefill_id`, `params`' fields in place, as a P/D proxy does; the
        reference's consumer reads what the params name: its pair needs no shared id."""
        self._add("consumer", request, forwarded_params(self.returned.get(prefill_id), params))

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        outcome = None if complete_transfers is None else (complete_transfers.fail_loads, False)
        results: dict[str, StepResult] = {}
        steps: dict[str, EngineStep] = {}
        for role, engine in self.engines.items():
            side = self.sides[role]
            side.output, side.returned = PairOutput(ranks=[RankOutput() for _ in range(engine.config.
                                                                                         tensor_parallel_size)]), {}
            results[role] = engine.step(outcome if role == "consumer" else None)
            steps[role] = self.engine_step(role, results[role])
        self.returned.update(steps["producer"].params)
        return merge([self.observers[role].step(results[role]) for role in self.engines],
                     DisaggregatedStep.model_construct(producer=steps["producer"], consumer=steps["consumer"]))

    def engine_step(self, role: str, result: StepResult) -> EngineStep:
        """Return an engine's connector facts of the step just run."""
        side, engine = self.sides[role], self.engines[role]
        done = side.output.done
        return EngineStep.model_construct(
            engine_id=PRODUCER_ID if role == "producer" else "decode-0",
            ranks=tuple(RankReport.model_construct(finished_sending=tuple(sorted(r.finished_sending)),
                                                   finished_recving=tuple(sorted(r.finished_recving)),
                                                   failed_recving=tuple(sorted(r.failed_recving)))
                        for r in side.output.ranks),
            finished_sending=tuple(sorted(done.finished_sending)),
            finished_recving=tuple(sorted(done.finished_recving)),
            failed_recving=tuple(sorted(done.failed_recving)),
            params=dict(side.returned),
            held={request_id: tuple(engine.kv.blocks_of(request_id)) for request_id in sorted(engine.delayed_free)},
            forward_writes=frozenset(result.forward_writes))

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        self.engines["consumer"].complete_transfers(fail_loads, fail_stores)


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
