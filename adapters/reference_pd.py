"""The reference P/D adapter: two reference engines, a producer and a consumer, joined by the reference pair of P/D
connectors (`reference.disaggregated`), behind the adapter contract of the disaggregated level (chapter
`disaggregated`).

Each engine is the reference `Engine` with one side of the pair in its connector seam (`ProducerSide`,
`ConsumerSide`): the producer's delays a finished request's free and returns its params; the consumer's answers a
remote prefill as one asynchronous load, which the harness completes (`complete_transfers`), each rank copying its
heads. Time is the producer's steps (`LEASE_STEPS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconform.adapters.pair import EnginePair, merge
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
    TransferOutcome,
)
from kvconform.common.version import KIT_VERSION
from kvconform.reference.disaggregated import (
    LEASE_STEPS,
    ConsumerConnector,
    ConsumerSide,
    PairOutput,
    PairSide,
    ProducerConnector,
    ProducerSide,
    RankOutput,
    Transport,
)
from kvconform.reference.engine import Engine, StepResult
from kvconform.reference.errors import InvalidCall
from kvconform.reference.observation import Observer

PRODUCER_ID = "prefill-0"
"""The producer's engine id, which its params name (`remote_engine_id`)."""

TENSOR_PARALLEL_SIZES = (1, 2, 4)
"""Ranks per engine the reference pair runs: each divides the default token width (8)."""


class ReferencePDAdapter(EnginePair):
    """Drives a producer and a consumer reference engine by their own scheduling policy (chapter `disaggregated`)."""

    name = "reference-pd"

    def __init__(self, *, producer: Callable[..., ProducerConnector] = ProducerConnector,
                 consumer: Callable[..., ConsumerConnector] = ConsumerConnector) -> None:
        """`producer` and `consumer` build the pair's connectors: the reference's, or a mutant's."""
        self.build_producer, self.build_consumer = producer, consumer
        self.engines: dict[str, Engine] = {}
        self.sides: dict[str, PairSide[Any]] = {}
        self.observers: dict[str, Observer] = {}
        self.returned: dict[str, dict[str, Any] | None] = {}
        """The producer's finished requests -> the params their `request_finished` returned, for `decode` to forward."""

    def implementation_version(self) -> str:
        return KIT_VERSION

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
        sides: dict[str, PairSide[Any]] = {
            "producer": ProducerSide(lambda gpu: self.build_producer(PRODUCER_ID, gpu, size, transport),
                                     config.block_size),
            "consumer": ConsumerSide(lambda gpu: self.build_consumer(gpu, size, transport), config.block_size)}
        for role, side in sides.items():
            engine = Engine(config, connector=side.scheduler, worker=side.attach)
            side.blocks_of = engine.kv.blocks_of
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

