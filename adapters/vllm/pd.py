"""`vllm-pd`: a P/D connector in two real vLLM engines, a producer (prefill) and a consumer (decode), judged at the
disaggregated level (chapter `disaggregated`).

Each engine is `vllm-connector`'s (a real vLLM scheduler, its worker-side connector per tensor-parallel rank, the
ranks aggregated by vLLM's `KVOutputAggregator`), in this process, with its own engine id and side channel. The
connector is `--connector` (vLLM's `NixlConnector` by default, or `module:Class`), with `--connector-config` over the
extra config below. The adapter is the proxy: it sends a prefill with `{"do_remote_decode": True}` and forwards the
params the harness hands it to the consumer unchanged. NIXL moves the KV between the engines' CPU tensors itself,
through its UCX backend over loopback (`kvconform install-vllm 0.34.0 --nixl`): its transfers and its lease run on
its own clock (`Capabilities.lease_seconds`).

With `KVCONFORM_PD_PROCESSES=2` (`--pd-processes 2`) the producer runs in a process of its own (`producer_server`), as a
deployment runs it: NIXL's side channel, handshake and reads then cross processes, and both engines' configs name one
model directory, so that the handshake's compatibility check (its hash includes the model) stays under test.

vLLM's NIXL worker runs on a CUDA, XPU, TPU or CPU platform; on CPU torch vLLM's platform is the unspecified one,
so `cpu_platform()` gives it the CPU platform's identity (`CpuPlatformSeam`).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import random
import socket
from typing import Any, cast

from pydantic import BaseModel

from kvconform.adapters.contract import ImplementationFailure
from kvconform.adapters.pair import EnginePair, merge
from kvconform.adapters.registry import AdapterNotFound
from kvconform.adapters.vllm import processes, runtime
from kvconform.adapters.vllm.connector import CONNECTOR, CONNECTOR_CONFIG, CONNECTOR_MANIFEST, VllmConnectorAdapter
from kvconform.adapters.vllm.engine import RankWorker, TransferSeam
from kvconform.common.forwarding import forwarded_params, missing_fields
from kvconform.common.values import (
    Capabilities,
    DisaggregatedStep,
    EngineConfig,
    EngineStep,
    RankReport,
    RequestSpec,
    StepObservation,
    TransferOutcome,
)

DEFAULT_CONNECTOR = "NixlConnector"

INSTALL = "kvconform install-vllm 0.34.0 --nixl"
"""The one-line install of what NixlConnector needs here: vLLM 0.34.0 and the NIXL wheels."""

LEASE_SECONDS = 4
"""The producer's lease (NIXL's `kv_lease_duration`, an int of seconds, 30 by default in 0.34
`nixl/base_scheduler.py`:82-86; 0.34 has no `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`): short, so that a run meets its end."""

PORTS = (20000, 32000)
"""Where the engines' side-channel ports are drawn from (vLLM's default, 5600, would be shared by both engines and by
parallel runs)."""

PROCESSES = "KVCONFORM_PD_PROCESSES"
"""The processes the pair runs in: "1", both engines in this one (the default), or "2", the producer in a process of
its own (`producer_server`)."""

LAYOUT = "LBHNC"
"""The KV-cache layout the NIXL worker asks for (`NixlConnector.get_required_kvcache_layout`), set on each engine's
config as vLLM's engine core would resolve it."""


@functools.cache
def cpu_platform() -> None:
    """Give vLLM's unspecified platform (CPU torch, CUDA wheel) what NIXL's worker needs of the CPU platform, once per
    process: its device type `cpu` (NIXL's supported-device row, `nixl/utils.py`), no NUMA nodes (the CPU platform
    would pin the process to a core with `sched_setaffinity`), a no-op `set_device` (the handshake thread calls it),
    and an attention backend (the unspecified platform has none): the CPU one, with the kernel block sizes of the
    base class (any), as the kit's one-head layout is not a kernel's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    platform = type(current_platform)
    platform.device_type = "cpu"
    platform.discover_numa_topology = classmethod(lambda cls: [])
    platform.set_device = classmethod(lambda cls, device: None)

    class KitAttentionBackend(CPUAttentionBackend):
        get_supported_kernel_block_sizes = staticmethod(AttentionBackend.get_supported_kernel_block_sizes)

    base_worker.get_current_attn_backends = lambda vllm_config, layer_names=None: [KitAttentionBackend]


class CpuPlatformSeam(TransferSeam):
    """The connector moves its KV itself; the seam only makes vLLM's platform a CPU one for its worker."""

    def prepare_worker(self) -> None:
        """Inside the engine's config context: the platform, vLLM's one-worker parallel state (the NIXL worker asks
        its rank), and the layout on the engine's config."""
        cpu_platform()
        runtime.single_worker_group()
        from vllm.config import get_current_vllm_config

        get_current_vllm_config().cache_config.kv_cache_layout = LAYOUT


def free_port() -> int:
    """Return a port drawn at random from PORTS that nothing on this machine listens on now."""
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(*PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AdapterNotFound(f"no free side-channel port in {PORTS[0]}-{PORTS[1]}")


class PDEngine(VllmConnectorAdapter):
    """One engine of the pair: `vllm-connector`'s, with an engine id, a side channel, and each request's params."""

    default_connector = DEFAULT_CONNECTOR
    seam = CpuPlatformSeam()

    def __init__(self, engine_id: str) -> None:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, in the rank processes too
        # NIXL logs each agent it builds to standard output, from its import on (its level names: nixl/logging.py)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.engine_id = engine_id
        super().__init__()
        self.delayed: set[str] = set()
        """Finished requests whose free the connector delays, until it reports them in `finished_sending`."""
        self.engine_step = EngineStep(engine_id=engine_id, ranks=())
        self.malformed: dict[str, list[str]] = {}
        """Remote prefills sent params lacking a field -> those fields (PD-PARAMS-2)."""

    def transfer_config(self) -> dict[str, Any]:
        return {**super().transfer_config(), "engine_id": self.engine_id, "kv_buffer_device": "cpu"}

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        return {"backends": ["UCX"], "kv_lease_duration": LEASE_SECONDS, **super().extra_config(config)}

    def start(self, config: EngineConfig) -> None:
        """Start the engine, then its side channel on a port of its own, serving every rank's handshake metadata as
        vLLM's engine core does (`EngineCore._set_kv_connector_handshake_metadata`)."""
        super().start(config)
        connector = self.scheduler.connector
        connector.connector_scheduler.side_channel_port = free_port()
        metadata = self._on_ranks("handshake_metadata")
        connector.set_xfer_handshake_metadata_pp_aware({(0, index): rank for index, rank in enumerate(metadata)})

    @property
    def rank_worker(self) -> type[PDRankWorker]:
        return PDRankWorker

    def rank_role(self, index: int) -> str:
        """Each engine of the pair has rank processes of its own."""
        return f"{self.engine_id}-rank-{index}"

    def add_request(self, request: RequestSpec, kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Queue `request`, noting params of a remote prefill that lack a field (PD-PARAMS-2)."""
        missing = missing_fields(kv_transfer_params)
        if missing:
            self.malformed[request.request_id] = missing
        super().add_request(request, kv_transfer_params)

    def attach(self) -> None:
        """Turn the connector's failure on params a proxy forwarded malformed into PD-PARAMS-2, a verdict
        (`failing_on_malformed_params`); a worker's raise on a read is PD-FAIL-1 in its rank (`PDRankWorker`)."""
        super().attach()
        connector = self.scheduler.connector
        for name in ("update_state_after_alloc", "build_connector_meta"):
            setattr(connector, name, self.failing_on_malformed_params(name, getattr(connector, name)))

    def failing_on_malformed_params(self, name: str, hook: Any) -> Any:
        """Return the scheduler-side connector's `hook`, a raise in it while a remote prefill with params lacking a
        field was sent a PD-PARAMS-2 verdict: NIXL 0.34 asserts in `update_state_after_alloc` on one without
        `remote_block_ids` (`nixl/pull_scheduler.py`:189), and its `build_connector_meta` raises KeyError for one
        aborted before it was scheduled (`nixl/pull_scheduler.py`:222-233 queues it to notify the producer,
        `nixl/metadata.py`:341 reads the field)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except Exception as error:
                if not self.malformed:
                    raise
                raise ImplementationFailure("PD-PARAMS-2", f"{name} raised {type(error).__name__} {error}: the "
                                                           "consumer was sent requests whose params lack fields it "
                                                           f"must refuse them for, {self.malformed}") from error

        return call

    def pair_step(self) -> tuple[StepObservation, EngineStep]:
        """Step the engine; return its observation and its connector facts for the pair's step."""
        return self.step(), self.engine_step

    def observe_connector(self, observation: dict[str, Any]) -> None:
        """Keep the step's connector facts for the pair's step (`EngineStep`)."""
        trace = self.trace
        self.delayed |= set(trace.free_delayed)
        self.delayed -= set(trace.saves_finished)
        self.engine_step = EngineStep.model_construct(
            engine_id=self.engine_id,
            ranks=tuple(trace.rank_reports) or (RankReport(),) * self.tensor_parallel_size,  # no batch processed
            finished_sending=tuple(sorted(trace.saves_finished)), finished_recving=tuple(sorted(trace.loads_finished)),
            failed_recving=tuple(sorted(set(trace.loads_failed) & set(trace.loads_finished))),
            params=dict(trace.finish_params),
            held={request_id: tuple(self.block_ids(request_id)) for request_id in sorted(self.delayed)},
            forward_writes=frozenset(trace.forward_writes))

    def close(self) -> None:
        """Stop the scheduler-side connector's side channel, then the ranks' workers (`PDRankWorker.close`) and the
        engine."""
        try:
            if self.scheduler is not None:  # started
                self.scheduler.connector.shutdown()
        finally:
            super().close()


class PDRankWorker(RankWorker):
    """A rank's worker of a pair's engine: a raise in its `start_load_kv` is a PD-FAIL-1 verdict (`failing_reads`), it
    gives the scheduler its handshake metadata, and its close releases NIXL's agent."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.worker.start_load_kv = failing_reads(self.worker.start_load_kv)

    def handshake_metadata(self) -> Any:
        """The metadata the engine's side channel serves for this rank (vLLM's engine core collects it from every
        worker, `EngineCore._set_kv_connector_handshake_metadata`)."""
        return self.worker.get_handshake_metadata()

    def close(self) -> None:
        """Stop the connector's threads, then release NIXL's agent now: its UCX threads poll until the agent is
        destroyed, and a failure's traceback keeps the worker alive through shrinking."""
        worker = self.worker
        try:
            super().close()
        finally:
            nixl_worker = getattr(worker, "connector_worker", None)
            if nixl_worker is not None and hasattr(nixl_worker, "nixl_wrapper"):
                nixl_worker.nixl_wrapper = None


def failing_reads(start_load_kv: Any) -> Any:
    """Return a worker's `start_load_kv`, a raise in it a PD-FAIL-1 verdict: a read that cannot be made must be reported
    failed, not take the engine down (NIXL 0.34 asserts on remote blocks fewer than the consumer's,
    `nixl/base_worker.py`:3910)."""

    def reads(*args: Any, **kwargs: Any) -> Any:
        try:
            return start_load_kv(*args, **kwargs)
        except Exception as error:
            raise ImplementationFailure("PD-FAIL-1", f"the consumer's start_load_kv raised {type(error).__name__} "
                                                     f"{error} instead of reporting the read failed") from error

    return reads


def renamed(value: Any, names: dict[str, str]) -> Any:
    """Return `value` with each string that `names` maps replaced, in any model or container it holds."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, BaseModel):
        return type(value).model_construct(**{field: renamed(getattr(value, field), names)
                                              for field in type(value).model_fields})
    if isinstance(value, dict):
        return {renamed(key, names): renamed(item, names) for key, item in value.items()}
    if isinstance(value, (tuple, list, set, frozenset)):
        return type(value)(renamed(item, names) for item in value)
    return value


def producer_server(model_directory: str | None = None) -> processes.Server:
    """Return this process's server of the pair's producer engine, started if none is alive with `model_directory`,
    by default the one this process's engines name (`runtime.MODEL_DIRECTORY`: across processes the handshake's
    compatibility hash includes the model)."""
    return processes.server("producer", "the producer's process", "kvconform.adapters.vllm.pd:open_engine",
                            {runtime.MODEL_DIRECTORY: model_directory or runtime.load().model_config.model})


def open_engine(engine_id: str, environment: dict[str, str | None]) -> PDEngine:
    """Build an engine with the connector `environment` names (`ProducerProcess.ENVIRONMENT`)."""
    for variable, setting in environment.items():
        if setting is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = setting
    return PDEngine(engine_id)


class ProducerProcess:
    """The pair's producer engine in this process's `producer_server`, with the `PDEngine` calls the pair makes."""

    ENVIRONMENT = (CONNECTOR, CONNECTOR_CONFIG, CONNECTOR_MANIFEST)
    """What names the connector, passed to the engine when it is built."""

    def __init__(self, engine_id: str) -> None:
        """Build the engine in the process (started first if there is none: outside any call's deadline)."""
        self.server = producer_server()
        self.call("open", engine_id, {variable: os.environ.get(variable) for variable in self.ENVIRONMENT})
        self.requests: set[str] = set()

    def call(self, method: str, *args: Any) -> Any:
        return self.server.call(method, *args)

    def start(self, config: EngineConfig) -> None:
        self.call("start", config)

    def add_request(self, request: RequestSpec, kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.call("add_request", request, kv_transfer_params)
        self.requests.add(request.request_id)

    def pair_step(self) -> tuple[StepObservation, EngineStep]:
        return self.call("pair_step")

    def abort(self, request_id: str) -> None:
        self.call("abort", request_id)

    def preempt(self, request_id: str) -> None:
        self.call("preempt", request_id)

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        return bool(self.call("reset_prefix_cache", reset_connector))

    def computed_kv(self, request_id: str) -> Any:
        return self.call("computed_kv", request_id)

    def resource_usage(self) -> Any:
        return self.call("resource_usage")

    def close(self) -> None:
        if self.server.alive:
            self.call("close")


class VllmPDAdapter(EnginePair):
    """A producer and a consumer vLLM engine with a P/D connector, stepped one after the other (chapter
    `disaggregated`)."""

    name = "vllm-pd"

    def __init__(self) -> None:
        count = os.environ.get(PROCESSES, "1")
        if count not in ("1", "2"):
            raise AdapterNotFound(f"{PROCESSES} must be 1 or 2, not {count!r}")
        consumer = PDEngine("decode-engine")
        if "Nixl" in consumer.connector_name and importlib.util.find_spec("nixl") is None:
            raise AdapterNotFound(f"{consumer.connector_name} needs the NIXL wheels, which are not installed: "
                                  f"{INSTALL}")
        producer = PDEngine("prefill-engine") if count == "1" else ProducerProcess("prefill-engine")
        self.engines = {"producer": producer, "consumer": consumer}
        self.lease_seconds = float(consumer.connector_config.get("kv_lease_duration", LEASE_SECONDS))
        """The producer's lease, on the connector's clock (PD-LEASE-1)."""
        self.request_ids: dict[str, str] = {}
        """Each request's id in its engine (`as_sent`), by the harness's id."""
        self.suffixes = itertools.count(1)
        self.returned: dict[str, dict[str, Any] | None] = {}
        """The producer's finished requests -> the params they returned, under the harness's ids, for `decode`."""

    def implementation_version(self) -> str:
        return self.engines["consumer"].implementation_version()

    def behaviours(self) -> tuple[str, ...]:
        return self.engines["consumer"].behaviours()

    def capabilities(self) -> Capabilities:
        """The consumer engine's, at the disaggregated level, with the producer's lease on the connector's clock."""
        fields = self.engines["consumer"].capabilities().model_dump()
        return Capabilities(**{**fields, "levels": ("disaggregated",), "lease_seconds": self.lease_seconds})

    def start(self, config: EngineConfig) -> None:
        for engine in self.engines.values():
            engine.start(config)

    def as_sent(self, request: RequestSpec, shared: str | None = None) -> RequestSpec:
        """Return `request` under the id its engine knows it by, as vLLM names a request it is sent: the id the proxy
        gave, `shared` by a prefill and the decode that reads it (a P/D proxy sends both engines one request id; NIXL's
        push mode pairs them by it, `nixl/push_worker.py`:436-468), and a random 8-hex suffix of the engine's
        (`v1/engine/input_processor.py`:359), here a count."""
        inner = f"{shared or request.request_id}-{next(self.suffixes):08x}"  # vLLM's suffix: 8 hex digits
        self.request_ids[request.request_id] = inner
        return request.model_copy(update={"request_id": inner})

    def add_request(self, request: RequestSpec) -> None:
        self.engines["consumer"].add_request(self.as_sent(request))

    def prefill(self, request: RequestSpec) -> None:
        self.engines["producer"].add_request(self.as_sent(request), {"do_remote_decode": True})

    def decode(self, request: RequestSpec, prefill_id: str, params: dict[str, Any] | None = None) -> None:
        """Forward what the producer returned for `prefill_id`, `params`' fields in place, as a P/D proxy does, the
        request ids in them as the engines know them; the decode shares the proxy's id of its prefill."""
        forwarded = forwarded_params(self.returned.get(prefill_id), params)
        self.engines["consumer"].add_request(self.as_sent(request, prefill_id), renamed(forwarded, self.request_ids))

    def abort(self, request_id: str) -> None:
        super().abort(self.request_ids.get(request_id, request_id))

    def preempt(self, request_id: str) -> None:
        super().preempt(self.request_ids.get(request_id, request_id))

    def computed_kv(self, request_id: str) -> Any:
        return super().computed_kv(self.request_ids.get(request_id, request_id))

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        """Step the producer, then the consumer; the step is reported under the harness's request ids."""
        (producer, producer_step), (consumer, consumer_step) = (self.engines[role].pair_step()
                                                                for role in ("producer", "consumer"))
        pair = merge([producer, consumer], DisaggregatedStep.model_construct(producer=producer_step,
                                                                             consumer=consumer_step))
        outer = {inner: outer for outer, inner in self.request_ids.items()}
        self.returned.update(renamed(producer_step.params, outer))
        return cast(StepObservation, renamed(pair, outer))

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """The connector completes its transfers itself (`harness_completes_transfers` False)."""

    def close(self) -> None:
        try:
            self.engines["producer"].close()
        finally:
            self.engines["consumer"].close()
