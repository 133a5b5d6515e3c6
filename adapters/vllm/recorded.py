"""A recorded real engine as the kit judges it: the program its trace shows and an adapter that answers as it did.

`recorder.py` records, in a real vLLM engine, every call the engine made to its connector. This module
reads such a trace (`kvconform check`, without vLLM) into what the connector level judges: the requests the engine
was given, in the order it first asked the connector about them, its aborts, and one `StepObservation` per engine step
(the records up to each `state` record: the scheduler's answers taken, its scheduled tokens and block tables, the
connector's reports, finishes and frees). `RecordedEngine` answers the execution's calls with them, so the judges of a
live run judge the recording (chapter `connector-level`): the engine's schedule is its own, its KV bytes are never
read (`Capabilities.reads_kv` is False: a real model's KV is not the kit's), and its output tokens are the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.adapters.vllm.engine import StepTrace
from kvconform.common.trace import TraceError, decode, read
from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    MatchAnswer,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreSnapshot,
    TransferOutcome,
)

ABORTED = "FINISHED_ABORTED"
Operation = tuple[str, tuple[Any, ...]]
"""A program operation and its arguments, as the checker applies them (`conformance.operations.Call`)."""
KV_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32"}


@dataclass
class EngineTrace:
    """A recorded engine read whole: its config, the program it ran, and what each of its steps did."""

    path: Path
    engine: dict[str, Any]
    config: EngineConfig
    program: list[Operation] = field(default_factory=list)
    observations: list[StepObservation] = field(default_factory=list)
    end_usage: ResourceUsage | None = None
    """What the engine held when its scheduler's connector shut down; None where the recording stopped first."""
    worker_calls: int = 0
    """The calls the worker sides recorded: read (each file must be a whole trace), not judged at this level."""

    @classmethod
    def read(cls, path: Path, header: dict[str, Any] | None = None) -> EngineTrace:
        """Return the recording at `path`; raise TraceError for one the connector level cannot judge as it is."""
        records = list(read(path))
        engine = records[0][1]["engine"]
        where = f"{path}:1"
        if engine["side"] != "scheduler":
            raise TraceError(f"{where}: a worker side's recording: check the scheduler's trace, which names it")
        if engine["async_scheduling"]:
            raise TraceError(f"{where}: recorded with async scheduling: the checker follows an engine's steps in sync "
                             "scheduling only")
        if (engine.get("kv_cache_groups") or 1) > 1:
            raise TraceError(f"{where}: recorded with {engine['kv_cache_groups']} KV-cache groups: the connector "
                             "level judges one")
        config = EngineConfig(block_size=engine["block_size"], num_gpu_blocks=engine["num_gpu_blocks"],
                              block_size_factor=1, num_offload_blocks=1, async_scheduling=False,
                              max_num_batched_tokens=engine["max_num_batched_tokens"],
                              kv_dtype=KV_DTYPES.get(engine.get("kv_dtype", "auto"), "bfloat16"),
                              tensor_parallel_size=engine["tensor_parallel_size"])
        trace = cls(path, engine, config, [("start", (config,))])
        _Reader(trace).read(records[1:])
        for worker in engine["worker_traces"]:
            trace.worker_calls += _worker_calls(path, Path(worker))
        return trace


def _worker_calls(scheduler: Path, worker: Path) -> int:
    """Return the calls a worker side's trace holds, found beside the scheduler's; raise TraceError for one that is
    missing or is not a whole trace."""
    beside = scheduler.with_name(worker.name)  # where the recording was moved with its worker traces
    if not beside.exists():
        raise TraceError(f"{scheduler}:1: the recording names the worker trace {worker.name}, which is not beside it")
    return sum(record["record"] == "hook" for _, record in read(beside))


class _Reader:
    """Reads a recording's records into its program and observations (`EngineTrace.read`)."""

    def __init__(self, trace: EngineTrace) -> None:
        self.trace = trace
        self.step = StepTrace()
        self.scheduled = False
        """The step's `build_connector_meta` was read: a finish after it is the step's, an abort before it came
        between steps."""
        self.pending: list[Operation] = []
        """The adds and aborts that came before the step being read."""
        self.specs: dict[str, RequestSpec] = {}
        self.tables: dict[str, list[int]] = {}
        self.outputs: dict[str, tuple[int, ...]] = {}
        self.live: set[str] = set()
        """The requests the engine has not finished."""
        self.used_gpu_blocks = 0
        """The GPU blocks in use after the latest step, as its `state` record counts them."""

    def read(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        for number, record in records:
            try:
                if record["record"] == "state":
                    self.end_step(record)
                elif record["record"] == "hook" and record["side"] == "scheduler":
                    getattr(self, f"on_{record['method']}", self.on_other)(record)
                else:
                    raise TraceError(f"a {record['record']} record in a recorded engine's scheduler trace")
            except (KeyError, TypeError, ValueError) as error:
                raise TraceError(f"{self.trace.path}:{number}: a {record.get('method', record['record'])} record the "
                                 f"checker cannot read ({type(error).__name__}: {error})") from None
        self.trace.program += self.pending
        if self.trace.end_usage is not None:
            self.trace.program.append(("drain", ()))

    # --- the scheduler's calls ------------------------------------------------------------------------

    def on_get_num_new_matched_tokens(self, record: dict[str, Any]) -> None:
        request = record["request"]
        self.learn(request)
        given, taken = decode(record["value"]), decode(record["taken"])
        for answer, answers in ((taken, self.step.match_answers), (given, self.step.masked_answers)):
            if answers is self.step.masked_answers and given == taken:
                break
            answers.append(MatchAnswer(request_id=request["id"], local_hit_tokens=record["num_computed_tokens"],
                                       external_tokens=answer[0], load_async=bool(answer[1]),
                                       num_tokens=request["num_tokens"]))

    def on_build_connector_meta(self, record: dict[str, Any]) -> None:
        step, block_size = self.step, self.trace.config.block_size
        self.scheduled = True
        step.scheduled_tokens = {request_id: int(tokens) for request_id, tokens in record["scheduled"].items()}
        step.preempted = set(record["preempted"])
        starts = {}
        for new in record["new"]:
            self.tables[new["id"]] = list(new["block_ids"])
            starts[new["id"]] = new["num_computed_tokens"]
        for cached in record["cached"]:
            table = self.tables.setdefault(cached["id"], [])
            table[:] = cached["new_block_ids"] if cached["id"] in record.get("resumed", ()) else [
                *table, *cached["new_block_ids"]]
            starts[cached["id"]] = cached["num_computed_tokens"]
        for request_id, tokens in step.scheduled_tokens.items():
            start = starts.get(request_id, 0)
            step.forward_writes.update(self.tables.get(request_id, [])[start // block_size: -(-(start + tokens)
                                                                                              // block_size)])

    def on_update_connector_output(self, record: dict[str, Any]) -> None:
        step = self.step
        step.loads_finished += record["finished_recving"]
        step.saves_finished += record["finished_sending"]
        step.freed += record["finished_sending"]  # a delayed free ends when the save is reported
        invalid = set(record["invalid_block_ids"])
        step.loads_failed += sorted(set(record["failed_recving"]) | {
            request_id for request_id in self.live if invalid & set(self.tables.get(request_id, ()))})

    def on_request_finished(self, record: dict[str, Any]) -> None:
        request = record["request"]
        self.learn(request)
        delay, _params = decode(record["value"])
        if request["status"] == ABORTED and not self.scheduled:
            self.pending.append(("abort", (request["id"],)))
        else:
            self.step.finished.append(request["id"])
        (self.step.free_delayed if delay else self.step.freed).append(request["id"])
        self.live.discard(request["id"])

    on_request_finished_all_groups = on_request_finished  # the finish hook a SupportsHMA connector gets

    def on_shutdown(self, record: dict[str, Any]) -> None:
        self.trace.end_usage = ResourceUsage(used_gpu_blocks=self.used_gpu_blocks, pinned_offload_blocks=0,
                                             jobs_in_flight=0, unfinished_requests=len(self.live))

    def on_other(self, record: dict[str, Any]) -> None:
        """A call the connector level does not judge (stats, events, handshakes): recorded, read, not judged."""

    def learn(self, request: dict[str, Any]) -> None:
        """Add a request the first time the engine asks about it, with its prompt, tenant and read flag."""
        request_id = request["id"]
        if request_id not in self.specs:
            spec = RequestSpec(request_id=request_id, prompt=tuple(request["prompt"]), max_tokens=request["max_tokens"],
                               skip_reading_prefix_cache=request["skip_reading_prefix_cache"],
                               cache_salt=request["cache_salt"], lora_name=request["lora_name"])
            self.specs[request_id] = spec
            self.pending.append(("add_request", (spec,)))
            self.live.add(request_id)

    def end_step(self, record: dict[str, Any]) -> None:
        """Close the step a `state` record ends: its observation, and the operations that led to it."""
        step, states = self.step, record["requests"]
        outputs = {request_id: tuple(state["output"]) for request_id, state in states.items()
                   if tuple(state["output"]) != self.outputs.get(request_id, ())}
        self.outputs.update(outputs)
        if record["used_gpu_blocks"] is not None:
            self.used_gpu_blocks = record["used_gpu_blocks"]
        computed = {request_id: state["num_computed_tokens"] for request_id, state in states.items()}
        self.trace.observations.append(StepObservation(**step.observed(computed, output_tokens=outputs)))
        self.trace.program += [*self.pending, ("step", ())]
        self.pending, self.step, self.scheduled = [], StepTrace(), False


class RecordedEngine(KVConnectorAdapter):
    """Answers the kit's calls as the recorded engine did: each step with the next recorded step's observation."""

    name = "recorded-engine"

    def __init__(self, trace: EngineTrace) -> None:
        self.trace = trace
        self.steps = iter(trace.observations)

    def implementation_version(self) -> str:
        engine = self.trace.engine
        return f"vLLM {engine['vllm']} with {engine['connector']}, recorded ({self.trace.path.name})"

    def capabilities(self) -> Capabilities:
        return Capabilities(levels=("connector",), async_scheduling=False, harness_completes_transfers=False,
                            reads_kv=False, preemption=False, transfer_failures=False, reset_connector=False,
                            eviction_policies=("lru",), block_size_factors=(1,),
                            tensor_parallel_sizes=(self.trace.config.tensor_parallel_size,))

    def start(self, config: EngineConfig) -> None:
        """The recorded engine's config, which the program's `start` gives."""

    def add_request(self, request: RequestSpec) -> None:
        """The engine was given the request before it asked its connector about it."""

    def abort(self, request_id: str) -> None:
        """The engine aborted the request between the steps the program has around this call."""

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        observation = next(self.steps, None)
        if observation is None:
            raise TraceError(f"{self.trace.path}: the recording holds no step past its "
                             f"{len(self.trace.observations)}")
        return observation

    def resource_usage(self) -> ResourceUsage:
        if self.trace.end_usage is None:
            raise TraceError(f"{self.trace.path}: the recording stopped before the engine shut down")
        return self.trace.end_usage

    def preempt(self, request_id: str) -> None:
        raise NotImplementedError("a recorded engine preempts as its scheduler did, never from outside")

    def reset_prefix_cache(self, reset_connector: bool) -> bool:
        raise NotImplementedError("a recorded engine's prefix-cache resets are its own")

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        raise NotImplementedError("a recorded engine's transfers completed on its own clock")

    def store_contents(self) -> StoreSnapshot:
        raise NotImplementedError("a recorded engine reports the connector level only (Capabilities.levels)")

    def computed_kv(self, request_id: str) -> torch.Tensor:
        raise NotImplementedError("a recorded engine's KV bytes are not in its trace (Capabilities.reads_kv)")

