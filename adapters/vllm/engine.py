"""The part every vLLM adapter shares: a real vLLM scheduler stepped like vLLM's engine core and model runner.

Real vLLM code: the `Scheduler` (or `AsyncScheduler`), its `KVCacheManager` and block pool, the request
block hasher, the scheduler side of the KV connector and the worker-side connector object. Not vLLM code:
the model forward. It writes each scheduled token's KV bytes with kvconform's KV content function into
real CPU tensors that are registered with the worker-side connector (`transfers.KVTensors`, the adapter's own, not
the reference's), and samples `kv_content.next_token`, so outputs are deterministic and equal the reference's
(XFER-DATA-1/2). Each
`step()` is one `EngineCore.step()` (sync) or `EngineCore.step_with_batch_queue()` (async, queue of 2),
with the worker-side connector called in the order of vLLM's model runner.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import inspect
import os
import pickle
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconform.adapters.contract import ImplementationFailure, KVConnectorAdapter
from kvconform.adapters.registry import AdapterNotFound
from kvconform.adapters.vllm import processes, runtime
from kvconform.adapters.vllm.transfers import HeldTransfers, KVTensors, RankedKV, RankedTransfers
from kvconform.common import kv_content
from kvconform.common.values import (
    EngineConfig,
    MatchAnswer,
    RankReport,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    TransferOutcome,
)

KV_LAYER = "model.layers.0.self_attn.attn"

RANKS = "KVCONFORM_RANKS"
"""Where the worker-side connectors of an engine with more than one tensor-parallel rank run: "processes" (the
default), each rank's in a process of its own (`RankWorker`), as vLLM's multiprocess executor runs them, the scheduler
side in this one; or "in-process", every rank's in this process, faster, and right only for a connector that keeps no
state per process (`--ranks in-process`)."""

RANK_MODES = ("processes", "in-process")


def ranks_in_processes() -> bool:
    """Return whether the ranks run in processes of their own (`RANKS`)."""
    mode = os.environ.get(RANKS) or "processes"
    if mode not in RANK_MODES:
        raise AdapterNotFound(f"{RANKS} must be one of {', '.join(RANK_MODES)}, not {mode!r}")
    return mode == "processes"

SCHEDULER = "vLLM's scheduler"
"""`VllmAdapter.seconds`: vLLM's `Scheduler` calls, the connector's scheduler side and the adapter's recording hooks
in them included."""

WORKERS = "the worker side"
"""`VllmAdapter.seconds`: the ranks' calls — the worker-side connector, the model-runner glue, the forward's writes,
and the round trips to rank processes."""

FINISH_HOOKS = ("request_finished", "request_finished_all_groups")
"""The connector's finish hooks, one of which the scheduler calls per finished request: `request_finished_all_groups`
for a `SupportsHMA` connector from 0.34 on (`v1/core/sched/scheduler.py`:3523-3535), else `request_finished`."""
"""The one attention layer of the KV layout the adapters register with vLLM."""


@dataclass
class StepTrace:
    """What vLLM's objects reported during one engine step: recorded by the adapter's wrappers, or read from a real
    engine's recording (`recorded.py`)."""

    scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    promoted: dict[str, int] = field(default_factory=dict)
    match_answers: list[MatchAnswer] = field(default_factory=list)
    masked_answers: list[MatchAnswer] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    forward_writes: set[int] = field(default_factory=set)
    store_reads_in_flight: set[int] = field(default_factory=set)
    loads_finished: list[str] = field(default_factory=list)
    loads_failed: list[str] = field(default_factory=list)
    free_delayed: list[str] = field(default_factory=list)
    saves_finished: list[str] = field(default_factory=list)
    finish_params: dict[str, Any] = field(default_factory=dict)
    """Requests that finished in the step -> the kv_transfer_params the connector's finish hook returned."""
    rank_reports: list[RankReport] = field(default_factory=list)
    """Each rank's connector output for the batch processed in the step, before the ranks were aggregated."""

    def observed(self, computed_tokens: dict[str, int], **more: Any) -> dict[str, Any]:
        """Return the StepObservation fields the step's records give, with each unfinished request's computed tokens
        after the step, and `more` fields (a recorded engine's output tokens)."""
        return dict(
            scheduled_tokens=self.scheduled_tokens, computed_tokens=computed_tokens,
            preempted=tuple(sorted(self.preempted)), promoted=dict(self.promoted),
            match_answers=tuple(self.match_answers), masked_answers=tuple(self.masked_answers),
            finished=tuple(self.finished), freed=tuple(self.freed), forward_writes=frozenset(self.forward_writes),
            store_reads_in_flight=frozenset(self.store_reads_in_flight), loads_finished=tuple(self.loads_finished),
            loads_failed=tuple(self.loads_failed), free_delayed=tuple(self.free_delayed),
            saves_finished=tuple(self.saves_finished), **more)


@dataclass
class Batch:
    """One scheduled step and the model runner's output for it, waiting for `update_from_output`."""

    scheduler_output: Any
    runner_output: Any
    sampled: dict[str, int]
    rank_reports: list[RankReport] = field(default_factory=list)
    """What each rank's worker reported for the batch, before aggregation."""


class FinishOrder(dict):
    """The scheduler's `finished_req_ids`, in the order the requests finished.

    vLLM keeps it in a Python `set` and the connector walks it (0.32+ offers each finished request's last
    blocks in that order, OFF-STORE-6), so the order follows string hashes and changes from one process to
    the next. Insertion order is one of the orders a set can take; it makes runs reproducible and
    comparable. It is the one piece of the scheduler's state the adapter replaces.
    """

    def add(self, request_id: str) -> None:
        self[request_id] = None


def wrap(obj: Any, name: str, after: Callable[..., None]) -> None:
    """Replace `obj.name` by a call to the original followed by `after(result, *args, **kwargs)`."""
    original = getattr(obj, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(result, *args, **kwargs)
        return result

    setattr(obj, name, recorded)


@dataclass
class AttentionLayer:
    """The one attention layer as vLLM's forward context lists it: layerwise connectors read its `kv_cache`."""

    kv_cache: torch.Tensor


class LayerMetadata:
    """Per-layer attention metadata: present, so that layerwise connectors act (with None they return at once)."""


class MixinGlue:
    """Up to 0.24: the worker-side connector called as `GPUModelRunner.execute_model` and its
    `KVConnectorModelRunnerMixin` do — preemptions, bind, start loads, forward, wait for save, get finished.

    The forward context carries per-layer attention metadata and lists the attention layer with its KV cache, and
    the forward waits for the layer's load before it writes and saves the layer after, as vLLM's attention layers
    do (`wait_for_layer_load`, `save_kv_layer`). The layer's KV cache is the block view `[blocks, 1, block_size,
    token_width]` of the KV tensor: one head holding K and V."""

    def __init__(self, rt: runtime.Runtime, vllm_config: Any, worker: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self.rt, self.vllm_config, self.worker = rt, vllm_config, worker
        self.mixin = rt.load("vllm.v1.worker.kv_connector_model_runner_mixin").KVConnectorModelRunnerMixin
        self.register_layers(kv_caches)
        worker.register_kv_caches(kv_caches)

    def register_layers(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = {name: AttentionLayer(kv.unsqueeze(1)) for name, kv in kv_caches.items()}
        self.vllm_config.compilation_config.static_forward_context.update(self.layers)
        self.metadata = {name: LayerMetadata() for name in self.layers}

    def forward_context(self) -> Any:
        return self.rt.load("vllm.forward_context").set_forward_context(self.metadata, self.vllm_config)

    def layerwise(self, forward: Callable[[], None]) -> None:
        """Run the forward between each layer's load wait and its save, as an attention layer does."""
        for name in self.layers:
            self.worker.wait_for_layer_load(name)
        forward()
        for name, layer in self.layers.items():
            self.worker.save_kv_layer(name, layer.kv_cache, self.metadata[name])

    def install(self) -> None:
        """Make this adapter's worker-side connector vLLM's process-wide KV transfer group."""
        state = self.rt.load("vllm.distributed.kv_transfer.kv_transfer_state")
        state._KV_CONNECTOR_AGENT = self.worker  # type: ignore[attr-defined]  # vLLM's module global, unknown to mypy

    def no_forward(self, scheduler_output: Any) -> Any:
        self.worker.handle_preemptions(scheduler_output.kv_connector_metadata)
        return self.mixin.kv_connector_no_forward(scheduler_output, self.vllm_config)

    def around_forward(self, scheduler_output: Any, forward: Callable[[], None]) -> Any:
        self.worker.handle_preemptions(scheduler_output.kv_connector_metadata)
        with self.forward_context(), self.mixin.maybe_get_kv_connector_output(scheduler_output) as connector_output:
            self.layerwise(forward)
        return connector_output


class ActiveConnectorGlue(MixinGlue):
    """0.32+: the worker-side connector called through vLLM's `ActiveKVConnector` (model runner v2) —
    preemptions and bind before the forward, loads, saves and finished transfers after it."""

    def __init__(self, rt: runtime.Runtime, vllm_config: Any, worker: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self.rt, self.vllm_config, self.worker = rt, vllm_config, worker
        self.install()
        self.register_layers(kv_caches)
        self.active = rt.load("vllm.v1.worker.gpu.kv_connector").ActiveKVConnector(vllm_config, kv_caches)

    def no_forward(self, scheduler_output: Any) -> Any:
        return self.active.no_forward(scheduler_output)

    def around_forward(self, scheduler_output: Any, forward: Callable[[], None]) -> Any:
        with self.forward_context():
            self.active.pre_forward(scheduler_output)
            self.layerwise(forward)
        self.active.finish_forward()
        return self.active.post_forward(scheduler_output.finished_req_ids)


SKIP_READ_REPLACEMENT = re.compile(r"get_num_new_matched_tokens\([^)]*\)\s*\)?\s*\n\s*if (?P<condition>[^\n]+):\s*\n"
                                  r"\s*ext_tokens, load_kv_async = 0, False")
"""How a release's `Scheduler.schedule` replaces a connector's answer itself, right after asking for it (0.34:
`if request.skip_reading_external_kv: ext_tokens, load_kv_async = 0, False`; 0.33 names another attribute)."""


@functools.cache
def skip_read_source(scheduler_class: type[Any]) -> str | None:
    """Return the condition under which the release's scheduler replaces a connector's answer by (0, False), as its
    code says it, or None where it takes every answer as given (0.23, 0.24)."""
    match = SKIP_READ_REPLACEMENT.search(inspect.getsource(scheduler_class.schedule))
    return None if match is None else match["condition"].strip()


@functools.cache
def skip_read_condition(scheduler_class: type[Any]) -> Any:
    """Return `skip_read_source` compiled, or None: the behaviour, never the version, decides how the answer the
    scheduler took is recorded (KVC-SKIP-1)."""
    source = skip_read_source(scheduler_class)  # type: ignore[arg-type]  # vLLM's class is untyped: not Hashable
    return None if source is None else compile(source, "<Scheduler.schedule>", "eval")


def detected_behaviours(rt: runtime.Runtime) -> tuple[str, ...]:
    """Return the behaviours of the release's scheduler that change what the judge sees, read from its code: whether it
    replaces a skip-read request's answer itself (KVC-SKIP-1: the connector's own answer is then a finding, not a
    failure) and whether it queues requests holding GPU blocks for their loads apart, ahead of the others
    (SCHED-ORDER-1: without that queue the release's file lists the deadlock)."""
    scheduler = rt.sched.Scheduler
    found = []
    condition = skip_read_source(scheduler)
    if condition is not None:
        found.append(f"skip-read-answer-replaced: Scheduler.schedule answers (0, False) itself if {condition}")
    if "kv_holding_waiting" in inspect.getsource(scheduler):
        found.append("block-holders-queued-first: Scheduler.kv_holding_waiting is served before the waiting queues")
    return tuple(found)


def runner_glue(rt: runtime.Runtime, vllm_config: Any, worker: Any, kv_caches: dict[str, torch.Tensor]) -> MixinGlue:
    """Return the model-runner glue of the installed release, which registers `kv_caches` with `worker`."""
    glue = ActiveConnectorGlue if getattr(vllm_config, "use_v2_model_runner", True) else MixinGlue
    return glue(rt, vllm_config, worker, kv_caches)


class TransferSeam:
    """How a connector's transfers run without CUDA. This one: the connector runs them itself, the kit lends it nothing.

    vLLM's own offloading connectors copy with CUDA kernels on their worker side; their seams
    (`offloading.OffloadingSeam`, `simple_cpu.SimpleCPUSeam`) put the adapters' own torch copies
    (`transfers.HeldTransfers`) in their place and size the connector's CPU store to the engine config; LMCache's
    (`lmcache.LMCacheSeam`) gives it a torch copy of its own. They are all a white-box adapter and `vllm-connector`
    need to run such a connector on CPU; what either observes is not the seam's business.
    """

    in_rank_processes = True
    """Whether the seam's worker side can be built in a rank process of its own (`RankWorker`): it prepares only that
    process. A seam that holds the worker's transfers for the harness (the white-box adapters') keeps the ranks in
    the adapter's process."""

    def capabilities(self) -> dict[str, Any]:
        """Return the capability fields the seam decides (policies, chunk sizes, failed transfers); none here."""
        return {}

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """Return the connector's extra config fields that plug the seam in and size its store; none here."""
        return {}

    def store_slots(self, config: EngineConfig) -> int:
        """Return the rows of the kit's CPU store tensor the seam's copies use; none here."""
        return 0

    def prepare_worker(self) -> None:
        """Give the worker process what the connector needs before it is built (called inside the engine's vLLM
        config context); nothing here."""

    def worker_built(self, worker: Any) -> None:
        """Put the seam's transfers into the worker-side connector; nothing here."""

    def close(self) -> None:
        """Release what the seam built beyond the engine (a vendor's process-wide state); nothing here."""

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Let the transfers the seam holds finish; with no seam the connector runs its transfers itself and the
        engine only waits for them in its steps."""


class VllmAdapter(KVConnectorAdapter):
    """Drives one real vLLM scheduler with a KV connector; subclasses add the connector-specific observations."""

    connector_name: str = ""
    seam: TransferSeam = TransferSeam()
    """How the connector's transfers run on this CPU-only machine; subclasses set theirs."""
    gpu_cache_reset: bool
    """What the GPU prefix cache's own reset last answered (recorded from `start` on): the result a failed
    `reset_prefix_cache` recovers with."""

    def __init__(self) -> None:
        self.rt = runtime.load()
        self._config: EngineConfig | None = None
        self.scheduler: Any = None
        self.worker: Any = None
        self.remote_ranks = False
        """Whether this engine's ranks run in processes of their own (`RANKS`)."""
        self.rank: int | None = None
        """The rank whose worker runs now (`at_rank`), or None between them."""
        self.seconds: defaultdict[str, float] = defaultdict(float)
        """Where the adapter's calls spent their time (`timed`): in vLLM's scheduler (`SCHEDULER`) and on the ranks'
        worker side (`WORKERS`); `kvconform bench` reports the split."""

    @property
    def config(self) -> EngineConfig:
        """Return the configuration the adapter was started with."""
        if self._config is None:
            raise RuntimeError(f"{self.name} has no configuration before start(config)")
        return self._config

    # --- what a connector adapter provides -----------------------------------------------------

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """Return the connector's `kv_connector_extra_config` for `config`: by default, its seam's."""
        return self.seam.extra_config(config)

    def attach(self) -> None:
        """Wrap the connector's objects once the scheduler and the worker-side connector exist; by default none."""

    def store_slots(self, config: EngineConfig) -> int:
        """Return the offloaded blocks the CPU store tensor holds: those of the seam."""
        return self.seam.store_slots(config)

    def transfer_config(self) -> dict[str, Any]:
        """Return more `KVTransferConfig` fields (a connector's module path); by default none."""
        return {}

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        self.seam.complete_transfers(fail_loads, fail_stores)

    @abc.abstractmethod
    def observe_metadata(self, meta: Any) -> None:
        """Record the load and store jobs of a step's connector metadata and issue them to `self.transfers`."""

    @abc.abstractmethod
    def observe_connector(self, observation: dict[str, Any]) -> None:
        """Add this step's connector fields (lookups, loads, offers, stores, evictions) to `observation`."""

    # --- the contract --------------------------------------------------------------------------

    def implementation_version(self) -> str:
        return f"vllm {self.rt.version}"

    def behaviours(self) -> tuple[str, ...]:
        """Return the scheduler's behaviours (`detected_behaviours`), then the connector's (`connector_behaviours`)."""
        return detected_behaviours(self.rt) + self.connector_behaviours()

    def connector_behaviours(self) -> tuple[str, ...]:
        """Return the behaviours of the connector the adapter drives, read from its code; by default none."""
        return ()

    def base_capabilities(self) -> dict[str, Any]:
        """Return the capabilities every vLLM adapter shares; no external preempt exists in vLLM. How each release's
        scheduler orders, admits and preempts needs no capability: the judge follows the schedule it observes."""
        scheduler = self.rt.sched.Scheduler
        return dict(preemption=False, abort=True, kv_cache_groups=1, reads_kv=True, complete_in_step=True,
                    reset_connector="reset_connector" in inspect.signature(scheduler.reset_prefix_cache).parameters)

    def check_supported(self, config: EngineConfig) -> None:
        """Refuse a configuration outside the capabilities: a factor, policy or behaviour variant it lacks."""
        lacking = self.capabilities().lacks(config)
        if lacking is not None:
            raise ValueError(f"{self.name} on vLLM {self.rt.version} supports {lacking}")

    @property
    def kv_tensors(self) -> Any:
        """Return the KV bytes of the rank whose worker runs now, else of every rank (`transfers.RankedKV`)."""
        return self.kv if self.rank is None else self.kv.ranks[self.rank]

    @property
    def transfers(self) -> Any:
        """Return the held transfers of the rank whose worker runs now, else of every rank (`RankedTransfers`)."""
        return self.all_transfers if self.rank is None else self.all_transfers.ranks[self.rank]

    def held_transfers(self) -> RankedTransfers:
        """Return the transfers each rank's worker submits: each rank copies its own heads."""
        return RankedTransfers(self.kv.ranks)

    def output_aggregator(self) -> Any:
        """Return vLLM's `KVOutputAggregator` as its executor builds it (`v1/executor/abstract.py`
        `init_kv_output_aggregator`): a request's transfer finishes once `connector.get_finished_count()` ranks, else
        every rank, reported it."""
        aggregator = self.rt.load("vllm.distributed.kv_transfer.kv_connector.utils").KVOutputAggregator
        return aggregator.from_connector(self.scheduler.connector, self.tensor_parallel_size)

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the context's wall time to `seconds[part]`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - started

    @contextlib.contextmanager
    def at_rank(self, rank: int) -> Iterator[None]:
        """Run rank `rank`'s worker in this process: the KV bytes and transfers the seams find (`kv_tensors`,
        `transfers`) are its."""
        self.rank = rank
        try:
            yield
        finally:
            self.rank = None

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks whose worker-side connectors run each step, each holding its share of the KV heads (vLLM's
        `--tensor-parallel-size`, the configuration's)."""
        return self._config.tensor_parallel_size if self._config is not None else 1

    def start(self, config: EngineConfig) -> None:
        self.check_supported(config)
        ranks = config.tensor_parallel_size
        if config.token_width % (2 * ranks):
            raise ValueError(f"token_width {config.token_width} must be a multiple of {2 * ranks}: each of the "
                             f"{ranks} ranks holds one head, a K and a V half")
        self._config = config
        self.trace = StepTrace()
        self.specs: dict[str, RequestSpec] = {}
        self.queue: list[Batch] = []
        self.lora_ids: dict[str, int] = {}
        self.requests: dict[str, Any] = {}
        self.kv = RankedKV(config, self.store_slots(config) * config.block_size_factor, ranks)
        self.all_transfers = self.held_transfers()
        self.vllm_config = self.rt.vllm_config(config, self.connector_name, self.extra_config(config),
                                               self.transfer_config(), tensor_parallel_size=ranks)
        self.kv_cache_config = self._kv_cache_config(config)
        kv_utils = self.rt.kv_utils
        block_size, hash_block_size = kv_utils.resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        hash_fn = self.rt.hashing.get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        kv_utils.init_none_hash(hash_fn)
        self.block_hasher = kv_utils.get_request_block_hasher(hash_block_size, hash_fn)
        scheduler_class = self.rt.async_sched.AsyncScheduler if config.async_scheduling else self.rt.sched.Scheduler
        self.scheduler = scheduler_class(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=self.rt.structured.StructuredOutputManager(self.vllm_config),
            block_size=block_size, hash_block_size=hash_block_size, log_stats=False,
        )
        self.remote_ranks = ranks > 1 and self.seam.in_rank_processes and ranks_in_processes()
        self.ranks: list[Any] = (self._rank_processes(ranks) if self.remote_ranks else  # RankWorker or RankProcess
                                 [self._build_rank(r) for r in range(ranks)])
        if self.remote_ranks:
            self.kv.ranks = list(self.ranks)  # the judge's bytes: each rank's heads, read from its process
        self.worker = self.ranks[0].worker  # None in a rank process
        self.aggregator = self.output_aggregator() if ranks > 1 else None
        self.scheduler.finished_req_ids = FinishOrder()
        wrap(self.scheduler.connector, "get_num_new_matched_tokens", self._record_match)
        for hook in FINISH_HOOKS:  # the one the release's scheduler calls for this connector
            if hasattr(self.scheduler.connector, hook):
                wrap(self.scheduler.connector, hook, self._record_finish_answer)
        wrap(self.scheduler, "_update_waiting_for_remote_kv", self._record_promotion)
        wrap(self.scheduler.kv_cache_manager, "free", self._record_free)
        if hasattr(self.scheduler.kv_cache_manager, "pop_blocks_for_free"):  # 0.24+: frees deferred in async mode
            wrap(self.scheduler.kv_cache_manager, "pop_blocks_for_free", self._record_free)
        wrap(self.scheduler.kv_cache_manager, "reset_prefix_cache",
             lambda result: setattr(self, "gpu_cache_reset", result))
        self.attach()

    @property
    def rank_worker(self) -> type[RankWorker]:
        """The class of each rank's worker; a subclass adds what its adapter asks of the worker side."""
        return RankWorker

    def rank_role(self, index: int) -> str:
        """Return the role of rank `index`'s process server: one per rank, reused by this process's engines in turn."""
        return f"rank-{index}"

    def start_rank_servers(self, ranks: int) -> list[processes.Server]:
        """Return the servers of ranks 0 .. `ranks - 1`, started at once (each imports vLLM) and ready."""
        servers = [processes.server(self.rank_role(index), f"the process of rank {index}",
                                    "kvconform.adapters.vllm.engine:open_rank") for index in range(ranks)]
        for server in servers:
            server.wait_ready()
        return servers

    def _rank_processes(self, ranks: int) -> list[RankProcess]:
        """Build each rank's worker (`rank_worker`) in its rank's process, with the rank's config and KV tensor."""
        servers = self.start_rank_servers(ranks)
        rows = self.store_slots(self.config) * self.config.block_size_factor
        for index, server in enumerate(servers):
            server.send("open", self.rank_worker, index, ranks, self.config, rows,
                        rank_config(self.vllm_config, index), self.kv_cache_config, self.seam, list(sys.path))
        rank_processes = [RankProcess(index, server) for index, server in enumerate(servers)]
        answers(rank_processes, "open")
        return rank_processes

    def _build_rank(self, index: int) -> RankWorker:
        """Build rank `index`'s worker (`rank_worker`) in this process, on the adapter's KV bytes and held transfers of
        the rank."""
        vllm_config = rank_config(self.vllm_config, index) if self.tensor_parallel_size > 1 else self.vllm_config
        with self.at_rank(index):
            return self.rank_worker(index, self.tensor_parallel_size, self.kv_tensors, self.transfers, vllm_config,
                                    self.kv_cache_config, self.seam)

    def close_ranks(self) -> None:
        """Stop every rank's worker-side connector, as vLLM's workers do at shutdown; rank processes stay for the
        next engine, and one that was lost has nothing left to stop."""
        for rank in getattr(self, "ranks", ()):
            if not self.remote_ranks:
                with self.at_rank(rank.index):
                    rank.close()
            elif rank.server.alive:
                rank.server.call("close")

    def _kv_cache_config(self, config: EngineConfig) -> Any:
        """Return a KVCacheConfig of one full-attention layer whose pages are the blocks of one rank's GPU KV tensor:
        one head per rank."""
        iface = self.rt.kv_iface
        spec = iface.FullAttentionSpec(block_size=config.block_size, num_kv_heads=1,
                                       head_size=config.token_width // (2 * self.tensor_parallel_size),
                                       dtype=self.kv.dtype)
        page = spec.page_size_bytes
        assert page == self.kv.page_bytes, "KV page size mismatch"
        size = page * config.num_gpu_blocks
        tensor = runtime.dataclass_kwargs(iface.KVCacheTensor, size=size, shared_by=[KV_LAYER], layers=[KV_LAYER],
                                          layer_stride=size, block_stride=page)
        if "shared_by" in vars(tensor):
            tensor.block_stride = 0  # up to 0.24 a non-zero block_stride means a packed multi-layer layout
        return iface.KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=[tensor],
                                   kv_cache_groups=[iface.KVCacheGroupSpec([KV_LAYER], spec)])

    def add_request(self, request: RequestSpec, kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Queue `request`; with `kv_transfer_params`, carrying them as a P/D proxy sends them (`Request.__init__`
        reads them from the sampling params' extra args)."""
        self.specs[request.request_id] = request
        sampling = self.rt.sampling.SamplingParams(
            max_tokens=request.max_tokens, ignore_eos=True,
            skip_reading_prefix_cache=True if request.skip_reading_prefix_cache else None,
            extra_args=None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params})
        lora = None
        if request.lora_name is not None:
            lora_id = self.lora_ids.setdefault(request.lora_name, len(self.lora_ids) + 1)
            lora = self.rt.lora.LoRARequest(lora_name=request.lora_name, lora_int_id=lora_id, lora_path="/nonexistent")
        self.requests[request.request_id] = self.rt.request.Request(
            request_id=request.request_id, prompt_token_ids=list(request.prompt), sampling_params=sampling,
            pooling_params=None, lora_request=lora, cache_salt=request.cache_salt, block_hasher=self.block_hasher)
        with self.timed(SCHEDULER):
            self.scheduler.add_request(self.requests[request.request_id])

    def abort(self, request_id: str) -> None:
        with self.timed(SCHEDULER):
            aborted = self.scheduler.finish_requests(request_id, self.rt.request.RequestStatus.FINISHED_ABORTED)
        self.trace.finished += [getattr(item, "request_id", None) or item[0] for item in aborted]

    def preempt(self, request_id: str) -> None:
        raise NotImplementedError("vLLM has no external preemption of one request (capabilities: preemption=False)")

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        """`Scheduler.reset_prefix_cache`; an error is what vLLM's engine core returns for a failed utility call:
        the engine stays up, and only the GPU prefix cache reset before the error took effect (0.28/0.30's connector
        reset asserts before it changes anything: 0.30.0 offloading/scheduler.py:1959-1961)."""
        try:
            if reset_connector:
                return self.scheduler.reset_prefix_cache(reset_connector=True)
            return self.scheduler.reset_prefix_cache()
        except Exception as error:
            clause = "OFF-MGR-8" if reset_connector else "PFX-RESET-1"
            raise ImplementationFailure(clause, f"Scheduler.reset_prefix_cache(reset_connector={reset_connector}) "
                                                f"raised {type(error).__name__}: {error}",
                                        recovered=True, result=self.gpu_cache_reset) from error

    # --- the step ------------------------------------------------------------------------------

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        """One engine-core step: EngineCore.step (sync) or step_with_batch_queue with a queue of 2 (async).

        `complete_transfers` finishes the held jobs at the worker's poll of its finished transfers in this step."""
        self.transfers.complete_at_poll(complete_transfers)
        if self.config.async_scheduling:
            self._step_with_batch_queue()
        elif self.scheduler.has_requests():
            batch = self._execute(self._schedule())
            self._process(batch)
        self.transfers.complete_at_poll(None)
        observation = self._observe()
        self.trace = StepTrace()
        return observation

    def _step_with_batch_queue(self) -> None:
        if self.scheduler.has_requests():
            self.queue.insert(0, self._execute(self._schedule()))
            if len(self.queue) < 2 and self.scheduler.has_requests():
                return
        elif not self.queue:
            return
        self._process(self.queue.pop())

    def _schedule(self) -> Any:
        """`Scheduler.schedule`; the finished-request set it starts afresh keeps finish order (`FinishOrder`)."""
        with self.timed(SCHEDULER):
            scheduler_output = self.scheduler.schedule()
        self.scheduler.finished_req_ids = FinishOrder()
        return scheduler_output

    def _execute(self, scheduler_output: Any) -> Batch:
        """Run the model runner's part of a step: vLLM's own runner-side connector calls around the forward."""
        self.trace.scheduled_tokens = dict(scheduler_output.num_scheduled_tokens)
        self.trace.preempted = set(scheduler_output.preempted_req_ids or ())
        self.transfers.begin_step()
        self.observe_metadata(scheduler_output.kv_connector_metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            outputs = self._on_ranks("no_forward", scheduler_output)
            reports = [self._rank_report(getattr(output, "kv_connector_output", None)) for output in outputs]
            return Batch(scheduler_output, self._aggregate(outputs), {}, reports)
        writes, sampled = self._forward(scheduler_output, self._runner_tokens(scheduler_output))
        connector_outputs = []
        for connector_output, store_reads in self._on_ranks("around_forward", scheduler_output, writes):
            connector_outputs.append(connector_output)
            self.trace.store_reads_in_flight |= store_reads
        req_ids = list(scheduler_output.num_scheduled_tokens)
        runner_outputs = [runtime.dataclass_kwargs(
            self.rt.outputs.ModelRunnerOutput, req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            kv_connector_output=connector_output) for connector_output in connector_outputs]
        reports = [self._rank_report(output) for output in connector_outputs]
        return Batch(scheduler_output, self._aggregate(runner_outputs), sampled, reports)

    def _on_ranks(self, method: str, *args: Any) -> list[Any]:
        """Return every rank's answer to `RankWorker.method(*args)`. Rank processes get the call at once, as
        `MultiprocExecutor` broadcasts a step to its workers, each a pickled copy of the arguments
        (`shm_broadcast.MessageQueue.enqueue`). Ranks here run in turn (`at_rank`), each with its own copy past one
        rank, so that a worker that consumes its connector metadata leaves the other ranks' intact; one worker gets
        the objects themselves, as from `UniProcExecutor`."""
        with self.timed(WORKERS):
            if self.remote_ranks:
                for rank in self.ranks:
                    rank.server.send(method, *args)
                return answers(self.ranks, method)
            results = []
            for rank in self.ranks:
                given = args if len(self.ranks) == 1 else pickle.loads(pickle.dumps(args))
                with self.at_rank(rank.index):
                    results.append(getattr(rank, method)(*given))
            return results

    def _aggregate(self, outputs: list[Any]) -> Any:
        """Return the runner output the scheduler gets: one worker's as it is (vLLM's `UniProcExecutor`), or rank 0's
        with every rank's connector outputs aggregated by vLLM's `KVOutputAggregator`, as `MultiprocExecutor` does
        (`v1/executor/multiproc_executor.py` `collective_rpc`)."""
        if self.aggregator is None:
            return outputs[0]
        return self.aggregator.aggregate([copy.copy(output) for output in outputs], output_rank=0)

    def _runner_tokens(self, scheduler_output: Any) -> dict[str, list[int]]:
        """Return each scheduled request's tokens as the model runner knows them: the scheduler's plus any
        sampled in a batch whose output is not processed yet (async scheduling)."""
        pending: dict[str, list[int]] = {}
        for batch in reversed(self.queue):
            for request_id, token in batch.sampled.items():
                pending.setdefault(request_id, []).append(token)
        tokens = {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            tokens[request_id] = list(request.all_token_ids) + pending.get(request_id, [])
        return tokens

    def _forward(self, scheduler_output: Any, runner_tokens: dict[str, list[int]]) -> tuple[list[Any], dict[str, int]]:
        """Return the forward's writes, every scheduled token's KV rows for its GPU blocks (`KVTensors.write`'s
        arguments: each rank writes its heads' columns), and the token sampled at each sequence end (XFER-DATA-1/2)."""
        sampled, writes = {}, []
        block_size = self.config.block_size
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            tokens = runner_tokens[request_id]
            end = request.num_computed_tokens
            start = end - num_new
            blocks = self.block_ids(request_id)
            states = self._token_states(request_id, tokens[:end])
            writes.append((blocks, start, kv_content.kv_values(states[start:end], self.config.token_width,
                                                               self.kv.dtype)))
            self.trace.forward_writes.update(blocks[start // block_size : -(-end // block_size)])
            if end == len(tokens):
                sampled[request_id] = kv_content.next_token(states[end - 1])
        return writes, sampled

    def _token_states(self, request_id: str, tokens: list[int]) -> list[int]:
        spec = self.specs[request_id]
        return kv_content.token_states(kv_content.initial_state(spec.lora_name, spec.cache_salt), tokens)

    def _process(self, batch: Batch) -> None:
        """`Scheduler.update_from_output`; finished requests are read from the engine-core outputs, the connector's
        reports (chapter `connector-level`) from the runner output it processes."""
        self._record_connector_output(getattr(batch.runner_output, "kv_connector_output", None))
        self.trace.rank_reports = batch.rank_reports
        with self.timed(SCHEDULER):
            outputs = self.scheduler.update_from_output(batch.scheduler_output, batch.runner_output)
        for engine_outputs in outputs.values():
            self.trace.finished += [o.request_id for o in engine_outputs.outputs if o.finish_reason is not None]

    # --- recording -----------------------------------------------------------------------------

    def _record_match(self, result: tuple[int | None, bool], request: Any, num_computed_tokens: int) -> None:
        """Record the answer as the scheduler takes it, and the connector's own where the scheduler replaces it: a
        release may answer a request that must not read external KV itself (`skip_read_replaced`). An answer past the
        request's tokens, or a synchronous one covering all of them, fails KVC-MATCH-1 here, before vLLM's scheduler
        fails a bare assertion on it (`assert num_computed_tokens <= request.num_tokens`, `assert num_new_tokens >
        0`)."""
        taken = (0, False) if self.skip_read_replaced(request) else tuple(result)
        answers = [self.trace.match_answers] + [self.trace.masked_answers] * (taken != tuple(result))
        for answer, recorded in zip((taken, result), answers, strict=False):  # one answer where none was replaced
            recorded.append(MatchAnswer(request_id=request.request_id, local_hit_tokens=num_computed_tokens,
                                        external_tokens=answer[0], load_async=answer[1],
                                        num_tokens=request.num_tokens))
        if taken[0] is not None and num_computed_tokens + taken[0] > request.num_tokens - (bool(taken[0])
                                                                                           and not taken[1]):
            raise ImplementationFailure("KVC-MATCH-1", f"get_num_new_matched_tokens answered {taken} for request "
                                                       f"{request.request_id!r} after a local hit of "
                                                       f"{num_computed_tokens}: past its {request.num_tokens} tokens, "
                                                       "or a synchronous load of all of them, which vLLM's scheduler "
                                                       "would fail an assertion on")

    def skip_read_replaced(self, request: Any) -> bool:
        """Return whether the release's scheduler replaces this request's answer by (0, False) itself, as its own
        `schedule` says right after asking the connector (`skip_read_condition`)."""
        # vLLM's scheduler is untyped here: mypy does not count its class, type[Any], as Hashable
        condition = skip_read_condition(type(self.scheduler))  # type: ignore[arg-type]
        return condition is not None and bool(eval(condition, {}, {"request": request, "self": self.scheduler}))

    def _record_finish_answer(self, result: tuple[bool, Any], request: Any, *args: Any) -> None:
        self.trace.finish_params[request.request_id] = result[1]
        if result[0]:
            self.trace.free_delayed.append(request.request_id)

    def _record_connector_output(self, output: Any) -> None:
        """Record what the worker-side connector reported: finished loads and saves, and the requests whose load
        failed, named per block (`invalid_block_ids`, by the requests that hold them) or per request (`failed_recving`,
        0.32+; the way 0.34's OffloadingConnector reports them)."""
        if output is None:
            return
        self._check_loads_in_flight(sorted(getattr(output, "finished_recving", None) or ()))
        self.trace.loads_finished += sorted(getattr(output, "finished_recving", None) or ())
        self.trace.saves_finished += sorted(getattr(output, "finished_sending", None) or ())
        self.trace.loads_failed += sorted(self._failed_loads(output))

    def _failed_loads(self, output: Any) -> set[str]:
        """Return the requests whose load a connector output reports failed: per request (`failed_recving`) or per
        block (`invalid_block_ids`, by the unfinished requests that hold them)."""
        failed_blocks = set(getattr(output, "invalid_block_ids", None) or ())
        return set(getattr(output, "failed_recving", None) or ()) | {
            request_id for request_id, request in self.scheduler.requests.items()
            if not request.is_finished() and failed_blocks & set(self.block_ids(request_id))}

    def _rank_report(self, output: Any) -> RankReport:
        """Return what one rank's connector output reports, before the ranks are aggregated (PD-TP-1)."""
        if output is None:
            return RankReport()
        return RankReport(finished_sending=tuple(sorted(getattr(output, "finished_sending", None) or ())),
                          finished_recving=tuple(sorted(getattr(output, "finished_recving", None) or ())),
                          failed_recving=tuple(sorted(self._failed_loads(output))))

    def _check_loads_in_flight(self, finished_recving: list[str]) -> None:
        """Refuse a finished load of a request vLLM is not waiting for (KVC-ASYNC-1) before vLLM's scheduler sees it:
        `_update_from_kv_xfer_finished` would fail a bare assertion on it."""
        status = self.rt.request.RequestStatus
        for request_id in finished_recving:
            request = self.scheduler.requests.get(request_id)
            if request is None or not (request.status == status.WAITING_FOR_REMOTE_KVS or request.is_finished()):
                where = "gone" if request is None else f"{request.status.name}, not WAITING_FOR_REMOTE_KVS"
                raise ImplementationFailure("KVC-ASYNC-1", f"get_finished reported the load of request {request_id!r} "
                                                           f"finished, but no load of it is in flight (the request is "
                                                           f"{where}): reported twice, or never started")

    def _record_promotion(self, result: Any, request: Any) -> None:
        """Record a waiting request whose finished load the scheduler takes up, after the answers given so far."""
        self.trace.promoted[request.request_id] = len(self.trace.match_answers)

    def _record_free(self, result: Any, request: Any) -> None:
        if request.is_finished():
            self.trace.freed.append(request.request_id)

    def _observe(self) -> StepObservation:
        observation = self.trace.observed({r: q.num_computed_tokens for r, q in self.scheduler.requests.items()
                                           if not q.is_finished()})
        self.observe_connector(observation)
        return StepObservation(**observation)

    # --- state the harness reads ---------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """Return the physical GPU blocks of a request (its block table in KV-cache group 0)."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def computed_kv(self, request_id: str) -> torch.Tensor:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return self.kv_tensors.read([], 0)
        return self.kv_tensors.read(self.block_ids(request_id), request.num_computed_tokens)

    def used_gpu_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return self.config.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def resource_usage(self) -> ResourceUsage:
        return ResourceUsage(used_gpu_blocks=self.used_gpu_blocks(), pinned_offload_blocks=self.pinned_offload_blocks(),
                             jobs_in_flight=self.jobs_in_flight(),
                             unfinished_requests=sum(not r.is_finished() for r in self.scheduler.requests.values()))

    @abc.abstractmethod
    def pinned_offload_blocks(self) -> int:
        """Return the offloaded blocks a load still reads."""

    @abc.abstractmethod
    def jobs_in_flight(self) -> int:
        """Return the transfer jobs the connector still waits for."""


class RankWorker:
    """One tensor-parallel rank's worker, as vLLM's worker process holds it: its share of the KV heads (`kv`), its
    worker-side connector built under the rank's config and parallel state (`runtime.tensor_parallel_rank`) with the
    seam's preparation, and the model-runner glue that calls it as vLLM's attention layers do. It lives in the
    adapter's process at one rank or with `--ranks in-process`, there with the adapter's held transfers of the rank
    (`transfers`), else in a rank process of its own (`open_rank`, driven through `RankProcess`)."""

    def __init__(self, index: int, ranks: int, kv: KVTensors, transfers: HeldTransfers | None, vllm_config: Any,
                 kv_cache_config: Any, seam: TransferSeam) -> None:
        self.rt = runtime.load()
        self.index, self.ranks, self.kv, self.transfers = index, ranks, kv, transfers
        with self.parallel_state(), self.rt.config.set_current_vllm_config(vllm_config):
            seam.prepare_worker()
            self.worker = self.rt.factory.KVConnectorFactory.create_connector(
                config=vllm_config, role=self.rt.connector_base.KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
            seam.worker_built(self.worker)
            self.runner = runner_glue(self.rt, vllm_config, self.worker, {KV_LAYER: kv.gpu})

    def parallel_state(self) -> contextlib.AbstractContextManager[None]:
        """vLLM's tensor-parallel getters answering this rank."""
        return runtime.tensor_parallel_rank(self.index, self.ranks)

    def no_forward(self, scheduler_output: Any) -> Any:
        """The model runner's step with no tokens scheduled: the connector's calls alone."""
        with self.parallel_state():
            self.runner.install()
            return self.runner.no_forward(scheduler_output)

    def around_forward(self, scheduler_output: Any, writes: list[Any]) -> tuple[Any, set[int]]:
        """The model runner's step: the connector's calls around the forward, which writes this rank's columns of
        `writes` (`KVTensors.write`'s arguments); return the connector output and the GPU blocks held stores still
        read as the forward writes (XFER-SAFE-1)."""
        store_reads: set[int] = set()

        def forward() -> None:
            store_reads.update(self.transfers.store_reads() if self.transfers is not None else ())
            for write in writes:
                self.kv.write(*write)

        with self.parallel_state():
            self.runner.install()
            return self.runner.around_forward(scheduler_output, forward), store_reads

    def read(self, gpu_blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self.kv.read(gpu_blocks, num_tokens)

    def read_store(self, first_row: int, num_rows: int) -> torch.Tensor:
        return self.kv.read_store(first_row, num_rows)

    def close(self) -> None:
        """Stop the connector's threads, as vLLM's worker does at shutdown."""
        if self.worker is not None:
            with self.parallel_state():
                self.worker, worker = None, self.worker
                worker.shutdown()


def open_rank(worker_class: type[RankWorker], index: int, ranks: int, config: EngineConfig, store_rows: int,
              vllm_config: Any, kv_cache_config: Any, seam: TransferSeam, path: list[str]) -> RankWorker:
    """Build rank `index`'s worker in its rank process (a `processes.Server`), on a KV tensor of its own, the
    connector's module found on the adapter's process's path."""
    sys.path[:0] = [entry for entry in path if entry not in sys.path]
    return worker_class(index, ranks, KVTensors(config, store_rows, index, ranks), None, vllm_config,
                        kv_cache_config, seam)


@dataclass
class RankProcess:
    """One tensor-parallel rank whose worker (`RankWorker`) runs in a process of its own: the adapter sends it the
    step's calls, and the judge reads its heads' KV bytes from there."""

    index: int
    server: processes.Server
    worker: Any = None

    def read(self, gpu_blocks: list[int], num_tokens: int) -> torch.Tensor:
        return self.server.call("read", list(gpu_blocks), num_tokens)

    def read_store(self, first_row: int, num_rows: int) -> torch.Tensor:
        return self.server.call("read_store", first_row, num_rows)


def answers(ranks: list[RankProcess], method: str) -> list[Any]:
    """Return each rank process's answer to the `method` call sent to all of them, or raise the first error once every
    answer is read, so that none is left for the next call to find."""
    results, errors = [], []
    for rank in ranks:
        try:
            results.append(rank.server.answer(method))
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]
    return results


def rank_config(vllm_config: Any, rank: int) -> Any:
    """Return the vLLM config of tensor-parallel rank `rank`'s worker process: the engine's, with its own
    `parallel_config.rank` and its own forward context (each rank's attention layer holds its own KV tensor)."""
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.rank = rank
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.static_forward_context = {}
    return config
