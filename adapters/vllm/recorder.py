"""A connector that records a real vLLM engine's connector calls as a trace (`kvconform check` judges it offline).

Loaded by vLLM's own `kv_connector_module_path`, it wraps the connector named in its `kv_connector_extra_config`
and delegates every call to it, recording each one with its arguments and its answer (or exception):

    KVTransferConfig(kv_connector="RecordingConnector", kv_connector_module_path="kvconform.adapters.vllm.recorder",
                     kv_role="kv_both", kv_connector_extra_config={
                         "trace": "run.jsonl", "connector": "OffloadingConnector",   # or module:Class
                         "connector_config": {...}})                                 # the wrapped one's extra config

The scheduler side writes `trace` (the file `kvconform check` takes), each rank's worker side a file of its own beside
it (`worker_trace`), in whatever process vLLM runs it. Values are summarised as the judge reads them (`SUMMARIES`):
request ids, token ids, token counts, block ids, the connector's answers and reports; KV bytes never. After the
scheduler's last call of a step (`take_events`, the end of `update_from_output`) a `state` record holds every live
request's computed tokens and the GPU blocks in use. The format is `common.trace`'s (docs/traces.md).

This module imports vLLM: only vLLM's connector factory loads it, never the kit.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler

from kvconform.adapters.vllm.engine import FINISH_HOOKS, skip_read_condition
from kvconform.common.trace import TraceWriter, encode, worker_trace
from kvconform.common.version import KIT_VERSION

PROPERTIES = ("requires_kv_delivery", "supports_divergent_local_hybrid_hits")
"""The base's properties a wrapper must delegate, or the base's defaults would answer for the wrapped connector."""

CLASS_METHODS = ("get_required_kvcache_layout", "requires_piecewise_for_cudagraph", "build_kv_connector_stats",
                 "build_prom_metrics")
"""The base's class methods, answered by the wrapped connector's class."""

UNRECORDED = {"has_connector_metadata"}
"""Calls too frequent and too empty to record: whether metadata is bound (twice per worker step)."""


def request_fields(request: Any) -> dict[str, Any]:
    """Return what the judge reads of a vLLM request: its id, tokens and status, and what makes it a RequestSpec."""
    lora = getattr(request, "lora_request", None)
    return {"id": request.request_id, "prompt": list(request.prompt_token_ids or ()),
            "output": list(request.output_token_ids), "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens, "status": request.status.name,
            "max_tokens": request.max_tokens, "skip_reading_prefix_cache": bool(request.skip_reading_prefix_cache),
            "cache_salt": request.cache_salt, "lora_name": None if lora is None else lora.lora_name}


def first_group(block_ids: Any) -> list[int]:
    """Return the block ids of KV-cache group 0, from vLLM's per-group tuple (the recorder runs with HMA off)."""
    return [] if block_ids is None else list(block_ids[0])


def _ids(values: Any) -> list[str]:
    return sorted(values or ())


def _matched(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    request, local = args
    condition = skip_read_condition(Scheduler)
    replaced = condition is not None and bool(eval(condition, {}, {"request": request, "self": None}))
    return {"request": request_fields(request), "num_computed_tokens": local, "value": encode(value),
            "taken": encode((0, False) if replaced else value)}


def _allocated(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    request, blocks, num_external_tokens = args
    return {"request": request.request_id, "block_ids": first_group(blocks.get_block_ids()),
            "num_external_tokens": num_external_tokens}


def _scheduled(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    output = args[0]
    cached = output.scheduled_cached_reqs
    return {"scheduled": dict(output.num_scheduled_tokens),
            "new": [{"id": new.req_id, "block_ids": first_group(new.block_ids),
                     "num_computed_tokens": new.num_computed_tokens} for new in output.scheduled_new_reqs],
            "cached": [{"id": request_id, "new_block_ids": first_group(blocks), "num_computed_tokens": computed}
                       for request_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                                               cached.num_computed_tokens, strict=True)],
            "resumed": _ids(getattr(cached, "resumed_req_ids", None)), "preempted": _ids(output.preempted_req_ids),
            "finished": _ids(output.finished_req_ids)}


def _reported(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    output = args[0]
    return {"finished_sending": _ids(output.finished_sending), "finished_recving": _ids(output.finished_recving),
            "failed_recving": _ids(getattr(output, "failed_recving", None)),
            "invalid_block_ids": sorted(getattr(output, "invalid_block_ids", None) or ())}


def _finished(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    request, block_ids = args[0], args[1]
    return {"request": request_fields(request), "value": encode(value),
            "block_ids": first_group(block_ids) if block_ids and isinstance(block_ids[0], (list, tuple))
            else list(block_ids)}


def _events(args: tuple[Any, ...], value: Any, recorder: RecordingConnector) -> dict[str, Any]:
    return {"events": [repr(event) for event in value]}


SUMMARIES: dict[str, Callable[[tuple[Any, ...], Any, RecordingConnector], dict[str, Any]]] = {
    "get_num_new_matched_tokens": _matched, "update_state_after_alloc": _allocated,
    "build_connector_meta": _scheduled, "update_connector_output": _reported, "take_events": _events,
    **dict.fromkeys(FINISH_HOOKS, _finished)}
"""How the judge reads each scheduler-side call: its arguments and answer as fields of its `hook` record. Any other
call is recorded by the type names of its arguments and the repr of its answer."""


def _generic(args: tuple[Any, ...], value: Any) -> dict[str, Any]:
    return {"args": [type(arg).__name__ for arg in args], "value": encode(value)}


class RecordingConnector(KVConnectorBase_V1):
    """The connector named in `kv_connector_extra_config["connector"]`, every call recorded (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        outer = vllm_config.kv_transfer_config
        extra = dict(outer.kv_connector_extra_config)
        if "trace" not in extra or "connector" not in extra:
            raise ValueError("RecordingConnector needs kv_connector_extra_config with 'trace' (the file to write) and "
                             "'connector' (the connector to record: a name vLLM knows, or module:Class)")
        module, _, name = str(extra["connector"]).rpartition(":")
        inner_config = copy.copy(vllm_config)  # as MultiConnector builds its children
        inner_config.kv_transfer_config = KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module or None, kv_role=outer.kv_role,
            engine_id=outer.engine_id, kv_connector_extra_config=dict(extra.get("connector_config", {})))
        inner_class = connector_class(str(extra["connector"]))
        super().__init__(vllm_config, role, kv_cache_config)
        self.inner = inner_class(inner_config, role, kv_cache_config)
        self.requests: dict[str, Any] = {}
        """The live vLLM requests the scheduler side has been asked about, by id: read for each `state` record."""
        self.kv_cache_manager: Any = None
        trace = Path(extra["trace"])
        scheduler = role == KVConnectorRole.SCHEDULER
        rank = vllm_config.parallel_config.rank
        self.side = "scheduler" if scheduler else "worker"
        self.rank = 0 if scheduler else rank
        self.writer = TraceWriter(trace if scheduler else worker_trace(trace, rank), engine={
            "side": self.side, "rank": self.rank, "pid": os.getpid(), "vllm": vllm.__version__,
            "kit": KIT_VERSION, "connector": extra["connector"], "connector_config": extra.get("connector_config", {}),
            "model": vllm_config.model_config.model,
            "block_size": vllm_config.cache_config.block_size,
            "num_gpu_blocks": None if kv_cache_config is None else kv_cache_config.num_blocks,
            "kv_cache_groups": None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups),
            "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
            "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
            "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
            "kv_dtype": str(vllm_config.cache_config.cache_dtype),
            "worker_traces": [str(worker_trace(trace, r)) for r in
                              range(vllm_config.parallel_config.tensor_parallel_size)] if scheduler else []})
        _INNER_CLASSES[type(self)] = inner_class

    def record(self, method: str, args: tuple[Any, ...], call: Callable[[], Any]) -> Any:
        """Make the wrapped connector's call and record it, its answer or exception."""
        started = time.monotonic()
        try:
            value = call()
        except Exception as error:
            self.writer.write("hook", side=self.side, rank=self.rank, method=method, at=started,
                              args=_generic(args, None)["args"], raised={"type": type(error).__name__,
                                                                         "message": str(error)})
            raise
        summary = SUMMARIES.get(method) if self.side == "scheduler" else None
        fields = summary(args, value, self) if summary is not None else _generic(args, value)
        self.writer.write("hook", side=self.side, rank=self.rank, method=method, at=started, **fields)
        if method in ("get_num_new_matched_tokens", *FINISH_HOOKS):
            self.requests[args[0].request_id] = args[0]
        if method == "bind_kv_cache_manager":
            self.kv_cache_manager = args[0]
        if method == "take_events":
            self.write_state()
        if method == "shutdown":
            self.writer.file.close()
        return value

    def write_state(self) -> None:
        """Record where the engine is after a step: each live request's computed tokens, the GPU blocks in use."""
        live = {request_id: request for request_id, request in self.requests.items() if not request.is_finished()}
        self.requests = live
        pool = None if self.kv_cache_manager is None else self.kv_cache_manager.block_pool
        used = None if pool is None else pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block aside
        self.writer.write("state", at=time.monotonic(), used_gpu_blocks=used,
                          requests={r: {"num_computed_tokens": q.num_computed_tokens, "status": q.status.name,
                                        "output": list(q.output_token_ids)} for r, q in live.items()})


_INNER_CLASSES: dict[type, type] = {}
"""The wrapped connector's class, once a recorder was built in this process: what the class methods delegate to."""


def _delegate(name: str) -> Callable[..., Any]:
    @functools.wraps(getattr(KVConnectorBase_V1, name))
    def delegated(self: RecordingConnector, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.inner, name)
        if name in UNRECORDED:
            return method(*args, **kwargs)
        return self.record(name, args, lambda: method(*args, **kwargs))
    return delegated


def _delegate_class_method(name: str) -> classmethod:
    """A class method answered by the wrapped connector's class, found from the config it is given (vLLM asks some
    before any connector is built), else from the recorder built in this process, else the base's."""
    base = getattr(KVConnectorBase_V1, name).__func__

    def delegated(cls: type, *args: Any, **kwargs: Any) -> Any:
        configs = [extra for extra in map(_extra_config, args) if extra]
        inner = connector_class(str(configs[0]["connector"])) if configs else _INNER_CLASSES.get(cls)
        return base(cls, *args, **kwargs) if inner is None else getattr(inner, name)(*args, **kwargs)
    return classmethod(functools.wraps(base)(delegated))


def _extra_config(arg: Any) -> dict[str, Any] | None:
    """Return the recorder's extra config from a class method's argument: a vLLM config, or the extra config itself."""
    transfer = getattr(arg, "kv_transfer_config", None)
    extra = transfer.kv_connector_extra_config if transfer is not None else arg
    return extra if isinstance(extra, dict) and "connector" in extra else None


def connector_class(spec: str) -> type:
    """Return the class of the connector to record (a name vLLM knows, or module:Class); raise ValueError, in one line,
    for one vLLM cannot load."""
    module, _, name = spec.rpartition(":")
    try:
        return KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both",
                                                                       kv_connector_module_path=module or None))
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"RecordingConnector cannot load the connector to record, {spec!r}: "
                         f"{type(error).__name__}: {error}") from None


def _delegate_property(name: str) -> property:
    def delegated(self: RecordingConnector) -> Any:
        return getattr(self.inner, name)
    return property(delegated)


for _name, _member in inspect.getmembers(KVConnectorBase_V1):
    if _name.startswith("_"):
        continue
    if _name in PROPERTIES:
        setattr(RecordingConnector, _name, _delegate_property(_name))
    elif _name in CLASS_METHODS and hasattr(KVConnectorBase_V1, _name):
        setattr(RecordingConnector, _name, _delegate_class_method(_name))
    elif callable(_member) and not isinstance(inspect.getattr_static(KVConnectorBase_V1, _name), (classmethod,
                                                                                                 staticmethod)):
        setattr(RecordingConnector, _name, _delegate(_name))
RecordingConnector.__abstractmethods__ = frozenset()
