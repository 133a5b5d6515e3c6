"""The engine step loop: scheduler, KV-cache manager, connector, model runner (spec chapter `lifecycle`).

One `step()` is: schedule → connector metadata → worker flushes and loads → forward → worker stores
→ output processing (SCHED-STEP-1). With async scheduling one batch is in flight: the output processed
in step k is that of step k-1 (SCHED-ASYNC-1).

A step schedules by a `SchedulingPolicy`: the spec's own (`OwnPolicy`), or `FollowingPolicy`, the choices another
engine's scheduler made in the same step (`FollowedSchedule`). Following, it runs its KV-cache manager, connector and
store from those choices, so what they must do is known for any schedule, and records what it could not follow
(`StepFacts.refused`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvconform.common import kv_content
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.reference.connector import (
    NO_DEVIATIONS,
    ConnectorUpdate,
    KnownDeviations,
    OffloadConnectorScheduler,
    OffloadConnectorWorker,
    SchedulerOutput,
)
from kvconform.reference.errors import InvalidCall
from kvconform.reference.kv_cache import KVCacheManager
from kvconform.reference.offload_manager import OffloadManager
from kvconform.reference.recorder import StepRecorder
from kvconform.reference.request import Request, RequestStatus
from kvconform.reference.transfer import TransferEngine


@dataclass
class Batch:
    """One scheduled step on its way through the model runner."""

    output: SchedulerOutput
    sampled: dict[str, int]
    connector_output: Any
    """What the worker side reported for the step (`ConnectorWorker.get_finished`)."""


class ConnectorScheduler(Protocol):
    """The engine's connector seam, scheduler side: what the engine asks of its connector (chapter `connector`). The
    offload connector (`connector.OffloadConnectorScheduler`) is one, each side of a P/D pair
    (`disaggregated.PairSide`) another."""

    @property
    def jobs(self) -> Collection[object]:
        """The transfer jobs the engine still waits for (LIFE-LEAK-1)."""

    @property
    def key_origin(self) -> Mapping[bytes, tuple[str, int]]:
        """Each offload key -> the request and offloaded block that first named it (`observation.Observer`)."""

    def on_new_request(self, request: Request) -> None: ...

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   deviations: KnownDeviations) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        ...

    def build_connector_meta(self, output: SchedulerOutput, deviations: KnownDeviations) -> Any:
        """Return the step's metadata, which the worker side gets (`ConnectorWorker.start_load_kv`)."""

    def request_finished(self, request: Request) -> bool:
        """Return True to delay freeing the request's GPU blocks."""

    def update_connector_output(self, output: Any) -> ConnectorUpdate:
        """Apply what the worker side reported (`ConnectorWorker.get_finished`)."""

    def reset_cache(self) -> None: ...
    def offload_keys(self, request: Request) -> list[bytes]: ...

    def take_events(self) -> list[dict[str, Any]]:
        """Return the connector's KV events since the last call, in order (chapter `kv-events`)."""


class ConnectorWorker(Protocol):
    """The engine's connector seam, worker side: what the model runner asks of its connector around the forward."""

    def start_load_kv(self, meta: Any) -> None: ...
    def store_sources_in_flight(self) -> set[int]: ...
    def wait_for_save(self, meta: Any) -> None: ...
    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None: ...
    def get_finished(self) -> Any: ...


@dataclass
class ConnectorReports:
    """What the connector reported to the engine in one step, per request (chapter `connector-level`)."""

    loads_finished: list[str] = field(default_factory=list)
    loads_failed: list[str] = field(default_factory=list)
    free_delayed: list[str] = field(default_factory=list)
    saves_finished: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FollowedSchedule:
    """The choices another engine's scheduler made in one step, for the reference to follow (SCHED-STEP-2)."""

    scheduled_tokens: dict[str, int]
    """Tokens per request, in the order they were scheduled."""
    considered: tuple[str, ...]
    """Waiting requests in the order the scheduler considered them: asked for matches, or resumed after a load."""
    admitted: frozenset[str]
    """Waiting requests it admitted: scheduled in this step, or waiting for their load."""
    preempted: frozenset[str]
    """Running requests it preempted to make room."""


@dataclass
class StepFacts:
    """What a step's scheduling did that no observation shows, for the checks of the schedule and the bytes."""

    running_at_schedule: list[str] = field(default_factory=list)
    """The requests running when the step began scheduling, in order (SCHED-PREEMPT-1, SCHED-ORDER-1)."""
    ready_holders: list[str] = field(default_factory=list)
    """Block holders whose load had ended when the step began admitting, taken up or not, in order (SCHED-ORDER-1)."""
    resumed: list[str] = field(default_factory=list)
    """Block holders that the step ran (SCHED-ORDER-1, LIFE-LOAD-2)."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """What a followed schedule asked that the free blocks did not allow: (clause, why) (SCHED-ALLOC-1)."""
    sampled_in_flight: Mapping[str, int] = field(default_factory=dict)
    """The token each request sampled in the batch still in flight, which the model runner already knows
    (SCHED-ASYNC-1)."""

    def runner_tokens(self, request: Request) -> tuple[int, ...]:
        """Return a request's tokens as the model runner knew them at the end of the step."""
        return runner_tokens(request, self.sampled_in_flight)


def runner_tokens(request: Request, sampled_in_flight: Mapping[str, int]) -> tuple[int, ...]:
    """Return a request's tokens as the model runner knows them: the scheduler's plus the one still in flight."""
    pending = sampled_in_flight.get(request.request_id)
    return request.tokens if pending is None else (*request.tokens, pending)


@dataclass
class StepResult:
    """What a step did, for `reference.observation` to turn into a `StepObservation`, and its `facts`."""

    scheduled_tokens: dict[str, int]
    computed_tokens: dict[str, int]
    trace: StepRecorder
    finished: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    forward_writes: set[int] = field(default_factory=set)
    store_reads_in_flight: set[int] = field(default_factory=set)
    reports: ConnectorReports = field(default_factory=ConnectorReports)
    preempted: set[str] = field(default_factory=set)
    facts: StepFacts = field(default_factory=StepFacts)
    kv_events: list[dict[str, Any]] = field(default_factory=list)
    """The step's batch of KV events: the block pool's, then the connector's (chapter `kv-events`)."""


class SchedulingPolicy(Protocol):
    """What a step's scheduler chooses (chapter `scheduling`); `Engine._schedule` carries the choices out.

    Two implement it: the spec's own policy (`OwnPolicy`), and another engine's choices followed (`FollowingPolicy`).
    """

    admits_after_preemption: bool
    """Whether waiting requests are considered in a step that preempted a running one (SCHED-ORDER-1)."""
    refused: list[tuple[str, str]]
    """The choices the free blocks did not allow: (clause, why)."""

    def running_tokens(self, request: Request, budget: int) -> int:
        """Return the tokens to schedule for a running request, 0 to skip it."""

    def victim(self, running: list[Request], request: Request) -> Request | None:
        """Return the running request to preempt for `request`'s room, None when there is none (SCHED-PREEMPT-1)."""

    def more_victims(self, running: list[Request]) -> list[Request]:
        """Return the running requests to preempt once the running ones are scheduled, newest first."""

    def queue(self, waiting: list[Request]) -> list[Request]:
        """Return the waiting requests to consider, in order (SCHED-ORDER-1)."""

    def considers(self, budget: int) -> bool:
        """Return True if the next waiting request is considered with `budget` tokens left."""

    def waiting_tokens(self, request: Request, num_computed: int, load_async: bool, budget: int) -> int | None:
        """Return the tokens to schedule for a waiting request `num_computed` tokens hit, None to leave it waiting."""

    def refuse(self, clause: str, why: str) -> bool:
        """The free blocks do not hold what was chosen: return True to go on with the next waiting request, the
        choice recorded as refused, or False to stop there; running requests stop there either way (SCHED-ALLOC-1,
        SCHED-ADMIT-1)."""


class OwnPolicy:
    """The spec's own scheduling policy: running requests first, each all it has left within the budget; then waiting
    ones in queue order, while the budget lasts, none in a step that preempted; the newest running request preempted
    for room (SCHED-ORDER-1, SCHED-PREEMPT-1)."""

    admits_after_preemption = False

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []

    def running_tokens(self, request: Request, budget: int) -> int:
        if len(request.output) + request.num_output_placeholders >= request.max_tokens:
            return 0
        return max(min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget), 0)

    def victim(self, running: list[Request], request: Request) -> Request | None:
        """Return the newest running request, `request` itself if it is the newest."""
        return running[-1]

    def more_victims(self, running: list[Request]) -> list[Request]:
        return []

    def queue(self, waiting: list[Request]) -> list[Request]:
        return list(waiting)

    def considers(self, budget: int) -> bool:
        return budget > 0

    def waiting_tokens(self, request: Request, num_computed: int, load_async: bool, budget: int) -> int | None:
        return 0 if load_async else min(request.num_tokens - num_computed, budget)

    def refuse(self, clause: str, why: str) -> bool:
        """Stop: a request the free blocks do not hold waits, and so do those behind it."""
        return False


@dataclass
class FollowingPolicy:
    """Another engine's scheduling choices in one step, followed: its tokens, its order, its admissions, its victims;
    what the free blocks do not allow is recorded as refused and the rest followed (SCHED-STEP-2)."""

    schedule: FollowedSchedule
    refused: list[tuple[str, str]] = field(default_factory=list)
    admits_after_preemption = True

    def running_tokens(self, request: Request, budget: int) -> int:
        return self.schedule.scheduled_tokens.get(request.request_id, 0)

    def victim(self, running: list[Request], request: Request) -> Request | None:
        """Return the newest of the running requests the followed scheduler preempted, None when none is left."""
        return next((r for r in reversed(running) if r.request_id in self.schedule.preempted), None)

    def more_victims(self, running: list[Request]) -> list[Request]:
        return [r for r in reversed(running) if r.request_id in self.schedule.preempted]

    def queue(self, waiting: list[Request]) -> list[Request]:
        by_id = {request.request_id: request for request in waiting}
        return [by_id[request_id] for request_id in self.schedule.considered if request_id in by_id]

    def considers(self, budget: int) -> bool:
        return True

    def waiting_tokens(self, request: Request, num_computed: int, load_async: bool, budget: int) -> int | None:
        if request.request_id not in self.schedule.admitted:
            return None
        return 0 if load_async else self.schedule.scheduled_tokens.get(request.request_id, 0)

    def refuse(self, clause: str, why: str) -> bool:
        self.refused.append((clause, why))
        return True


@dataclass
class Scheduling:
    """One step's scheduling under way: the policy it follows, and what it has chosen so far."""

    policy: SchedulingPolicy
    deviations: KnownDeviations
    budget: int
    preempted: set[str]
    """Requests preempted since the previous schedule, and by this one to make room (SCHED-PREEMPT-1)."""
    facts: StepFacts
    scheduled: dict[str, int] = field(default_factory=dict)
    allocated: set[int] = field(default_factory=set)
    first_run: set[int] = field(default_factory=set)


class Engine:
    """The reference engine: the spec's state machine, driven one step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device | None = None,
        *,
        kv: Callable[[int, int], KVCacheManager] = KVCacheManager,
        manager: Callable[[int, str, bool], OffloadManager] = OffloadManager,
        connector: Callable[[OffloadManager, EngineConfig, StepRecorder], ConnectorScheduler] = (
            OffloadConnectorScheduler),
        worker: Callable[[TransferEngine, bool], ConnectorWorker] = OffloadConnectorWorker,
        policy: Callable[[], SchedulingPolicy] = OwnPolicy,
    ) -> None:
        """Build the engine for `config` from its parts, each made by the factory of its name: the reference's
        classes, or a part a caller hands in instead (a mutant's, a P/D pair's side: `ConnectorScheduler`,
        `ConnectorWorker`)."""
        self.config = config
        self.kv = kv(config.num_gpu_blocks, config.block_size)
        self.recorder = StepRecorder()
        self.manager = manager(config.num_offload_blocks, config.eviction_policy, config.arc_t1_fallback)
        self.connector = connector(self.manager, config, self.recorder)
        self.transfer = TransferEngine(config.num_gpu_blocks, config.num_offload_blocks, config.block_size,
                                       config.block_size_factor, config.token_width, config.kv_dtype, device)
        self.worker = worker(self.transfer, config.defer_stores)
        self.policy = policy()
        """The scheduling policy of a step that follows no other engine's schedule."""
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loads_done: dict[str, bool] = {}
        self.holders: dict[str, int] = {}
        """Waiting requests that hold GPU blocks, admitted with a load → when; considered first until they run."""
        self.load_order = itertools.count()
        self.delayed_free: set[str] = set()
        self.preempted_since_schedule: set[str] = set()
        self.inflight_prefills: set[str] = set()
        self.finished_since_schedule: list[str] = []
        self.scheduled_steps = 0
        self.processed_steps = 0
        self.last_scheduled: dict[str, int] = {}
        self.deferred_frees: list[tuple[int, list[int]]] = []
        self.in_flight: Batch | None = None
        self._step_finished: list[str] = []
        self._step_freed: list[str] = []
        self._step_reports = ConnectorReports()

    # --- requests --------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Queue a new request (LIFE-ADD-1)."""
        if spec.request_id in self.requests:
            raise InvalidCall("LIFE-ADD-1", f"request id {spec.request_id!r} was already used")
        request = Request(spec.request_id, tuple(spec.prompt), spec.max_tokens, self.config.block_size,
                          spec.skip_reading_prefix_cache, spec.cache_salt, spec.lora_name)
        self.requests[spec.request_id] = request
        self.waiting.append(request)
        self.connector.on_new_request(request)

    def _unfinished(self, request_id: str, clause: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            raise InvalidCall(clause, f"unknown request id {request_id!r}")
        if request.is_finished:
            raise InvalidCall(clause, f"request {request_id!r} has already finished")
        return request

    def abort(self, request_id: str) -> None:
        """Abort an unfinished request; its blocks are freed unless the connector delays it (LIFE-ABORT-1)."""
        request = self._unfinished(request_id, "LIFE-ABORT-1")
        (self.running if request in self.running else self.waiting).remove(request)
        self._finish(request, RequestStatus.ABORTED)

    def preempt(self, request_id: str) -> None:
        """Preempt a running request: free its blocks, recompute from scratch later (LIFE-PREEMPT-1)."""
        request = self._unfinished(request_id, "LIFE-PREEMPT-1")
        if request.status is not RequestStatus.RUNNING:
            raise InvalidCall("LIFE-PREEMPT-1", f"request {request_id!r} is not running")
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request.request_id)
        self.inflight_prefills.discard(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        self.waiting.insert(0, request)
        self.preempted_since_schedule.add(request.request_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a request: ask the connector, then free or delay (CONN-FIN-1, LIFE-FREE-1)."""
        request.status = status
        self.inflight_prefills.discard(request.request_id)
        self.holders.pop(request.request_id, None)
        self._step_finished.append(request.request_id)
        self.finished_since_schedule.append(request.request_id)
        if self.connector.request_finished(request):
            self.delayed_free.add(request.request_id)
            self._step_reports.free_delayed.append(request.request_id)
        else:
            self._free(request.request_id)

    def _free(self, request_id: str) -> None:
        self._release(request_id)
        self._step_freed.append(request_id)

    def _release(self, request_id: str) -> None:
        """Return a request's GPU blocks to the pool; while a step that scheduled it is still in flight, only once
        that step's output is processed, as the forward may still write them (LIFE-FREE-3)."""
        if self.last_scheduled.get(request_id, 0) <= self.processed_steps:
            self.kv.free(request_id)
        else:
            self.deferred_frees.append((self.scheduled_steps, self.kv.pop_blocks(request_id)))

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Reset the local prefix cache, and the offload store if asked (PFX-RESET-1, OFF-MGR-8)."""
        if reset_connector:
            self.connector.reset_cache()
        return self.kv.pool.reset()

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Let every in-flight job finish now; results reach the scheduler at the next step (CONN-STEP-4)."""
        self.worker.complete_transfers(fail_loads, fail_stores)

    # --- the step -----------------------------------------------------------------------

    def step(self, complete_in_step: tuple[bool, bool] | None = None, followed: FollowedSchedule | None = None,
             deviations: KnownDeviations = NO_DEVIATIONS) -> StepResult:
        """Run one engine step (SCHED-STEP-1); an engine without work only processes the batch in flight.

        With `complete_in_step` (whether loads fail, whether stores fail), the jobs in flight finish after the step's
        stores are submitted, before the worker reports its finished jobs: they are reported in this step
        (CONN-STEP-4). With `followed`, the step schedules as another engine's scheduler did, and its connector and
        store take that engine's `deviations`. The result's `facts` say what the scheduling did that the
        observation does not show."""
        scheduled: dict[str, int] = {}
        writes: set[int] = set()
        reads_in_flight: set[int] = set()
        preempted: set[str] = set()
        facts = StepFacts()
        if self.has_work():
            preempted_before = set(self.preempted_since_schedule)
            policy = self.policy if followed is None else FollowingPolicy(followed)
            output = self._schedule(Scheduling(policy, deviations, self.config.max_num_batched_tokens,
                                               self.preempted_since_schedule, facts))
            facts.refused = list(policy.refused)
            preempted = output.preempted_request_ids - preempted_before
            if self.config.async_scheduling and output.num_scheduled_tokens:
                self.scheduled_steps += 1
                self.last_scheduled.update(dict.fromkeys(output.num_scheduled_tokens, self.scheduled_steps))
            meta = self.connector.build_connector_meta(output, deviations)
            start_positions = self._advance(output)
            self.worker.start_load_kv(meta)
            reads_in_flight = self.worker.store_sources_in_flight()
            sampled, writes = self._forward(output, start_positions)
            self.worker.wait_for_save(meta)
            if complete_in_step is not None:
                self.worker.complete_transfers(*complete_in_step)
            scheduled = dict(output.num_scheduled_tokens)
            self._run(Batch(output, sampled, self.worker.get_finished()))
        elif self.in_flight is not None:
            previous, self.in_flight = self.in_flight, None
            self._process(previous)
        facts.sampled_in_flight = {} if self.in_flight is None else self.in_flight.sampled
        result = StepResult(scheduled, self._computed_tokens(), self.recorder.take(), self._step_finished,
                            self._step_freed, writes, reads_in_flight, self._step_reports, preempted, facts,
                            self.take_events())
        self._step_finished, self._step_freed, self._step_reports = [], [], ConnectorReports()
        return result

    def take_events(self) -> list[dict[str, Any]]:
        """Return the step's batch of KV events, as vLLM's scheduler publishes it: the block pool's, then the
        connector's (EVT-ORDER-1)."""
        return self.kv.pool.take_events() + self.connector.take_events()

    def has_work(self) -> bool:
        """Return True while a request is unfinished (waiting or running), unfreed or finished since the last step,
        or a transfer job is pending (SCHED-STEP-1)."""
        return bool(self.waiting or self.running or self.finished_since_schedule or self.delayed_free
                    or self.connector.jobs)

    def _run(self, batch: Batch) -> None:
        """Process a batch now (sync), or keep it in flight and process the previous one (SCHED-ASYNC-1)."""
        if not self.config.async_scheduling:
            self._process(batch)
            return
        previous, self.in_flight = self.in_flight, batch
        if previous is not None:
            self._process(previous)

    def _computed_tokens(self) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens for r in (*self.waiting, *self.running)}

    def _schedule(self, step: Scheduling) -> SchedulerOutput:
        """Schedule running requests first, then waiting ones, within the token budget (SCHED-ORDER-1)."""
        policy = step.policy
        self.preempted_since_schedule = set()
        step.facts.running_at_schedule = [request.request_id for request in self.running]
        for request in list(self.running):
            if request not in self.running:
                continue
            num_new = policy.running_tokens(request, step.budget)
            if num_new == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, step)
            if new_blocks is None:
                break
            step.allocated.update(new_blocks)
            step.scheduled[request.request_id] = num_new
            step.budget -= num_new
        for request in policy.more_victims(self.running):
            self._preempt_victim(request, step.preempted)
        if policy.admits_after_preemption or not step.preempted:
            self._schedule_waiting(step)
        finished, self.finished_since_schedule = self.finished_since_schedule, []
        scheduled = step.scheduled
        return SchedulerOutput(scheduled, {rid: self.requests[rid] for rid in scheduled},
                               {rid: list(self.kv.blocks_of(rid)) for rid in scheduled}, step.allocated,
                               step.preempted, finished, step.first_run)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: Scheduling) -> list[int] | None:
        """Allocate for a running request, preempting the policy's victims until it fits (SCHED-PREEMPT-1); with no
        victim left, the allocation is refused (SCHED-ALLOC-1)."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, [], 0, delay_caching=False)
            if new_blocks is not None:
                return new_blocks
            victim = step.policy.victim(self.running, request)
            if victim is None:
                step.policy.refuse("SCHED-ALLOC-1", f"{request.request_id!r} was scheduled {num_new} tokens, for which "
                                                    f"the free blocks do not hold")
                return None
            self._preempt_victim(victim, step.preempted)
            if victim is request:
                return None

    def _preempt_victim(self, victim: Request, preempted: set[str]) -> None:
        """Preempt a running request to make room in this step's scheduling (SCHED-PREEMPT-1)."""
        self._preempt(victim)
        preempted.add(victim.request_id)
        self.preempted_since_schedule.discard(victim.request_id)

    def _schedule_waiting(self, step: Scheduling) -> None:
        """Admit waiting requests in the policy's order: take up finished loads, ask the local prefix cache, then the
        connector (CONN-MATCH-1), and allocate for the full sequence (SCHED-ADMIT-1, SCHED-ALLOC-1)."""
        self.order_waiting()
        step.facts.ready_holders = [request.request_id for request in self.waiting if request.request_id in self.holders
                                    and (request.request_id in self.loads_done
                                         or request.status is not RequestStatus.WAITING_FOR_LOAD)]
        policy = step.policy
        for request in policy.queue(self.waiting):
            if not policy.considers(step.budget):
                break
            if request.status is RequestStatus.WAITING_FOR_LOAD:
                if request.request_id not in self.loads_done:
                    continue
                self._finish_load(request, self.loads_done.pop(request.request_id))
            local_blocks: list[int] = []
            num_local = num_external = 0
            load_async = False
            if request.num_computed_tokens == 0:
                local_blocks, num_local = self.kv.get_computed_blocks(request)
                answer, load_async = self.connector.get_num_new_matched_tokens(request, num_local, step.deviations)
                self.recorder.answers.append((request.request_id, num_local, answer, load_async))
                if answer is None:
                    continue  # asked again in a later step, keeping its place (SCHED-ORDER-1)
                num_external = answer
            num_computed = request.num_computed_tokens + num_local + num_external
            num_new = policy.waiting_tokens(request, num_computed, load_async, step.budget)
            if num_new is None:
                continue  # the policy leaves it waiting
            new_blocks = None
            if self.kv.holds_sequence(request, local_blocks):  # the full sequence must fit, not only the first chunk
                reserved = self._prefill_reservation() if load_async else 0
                new_blocks = self.kv.allocate_slots(request, num_new, local_blocks, num_external,
                                                    delay_caching=load_async, reserved=reserved)
            if new_blocks is None:
                if policy.refuse("SCHED-ADMIT-1", f"{request.request_id!r} was admitted, but the free blocks do not "
                                                  f"hold its full sequence ({request.num_tokens} tokens)"):
                    continue
                break
            step.allocated.update(new_blocks)
            step.first_run.update(local_blocks)
            self.connector.update_state_after_alloc(request, self.kv.blocks_of(request.request_id), num_external)
            request.num_computed_tokens = num_computed
            if load_async or num_computed + num_new < request.num_tokens:
                self.inflight_prefills.add(request.request_id)
            if load_async:
                request.num_local_hit_tokens = num_local
                request.status = RequestStatus.WAITING_FOR_LOAD
                self.holders.setdefault(request.request_id, next(self.load_order))
                continue
            if self.holders.pop(request.request_id, None) is not None:
                step.facts.resumed.append(request.request_id)
                step.first_run.update(self.kv.blocks_of(request.request_id))
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.scheduled[request.request_id] = num_new
            step.budget -= num_new

    def _prefill_reservation(self) -> int:
        """Return the blocks that in-flight prefills still need to hold their full sequence (SCHED-ADMIT-1)."""
        return sum(max(-(-self.requests[r].num_tokens // self.config.block_size) - len(self.kv.blocks_of(r)), 0)
                   for r in self.inflight_prefills)

    def order_waiting(self) -> None:
        """Put the waiting requests that hold GPU blocks first, in the order their loads were admitted; the others keep
        their queue order (SCHED-ORDER-1)."""
        self.waiting.sort(key=lambda request: (0, self.holders[request.request_id])
                          if request.request_id in self.holders else (1, 0))

    def _finish_load(self, request: Request, success: bool) -> None:
        """Cache a finished load's blocks, or after a failure those of the local hit the request fell back to
        (LIFE-LOAD-1, LIFE-LOAD-2, LIFE-LOAD-3)."""
        self.recorder.promoted[request.request_id] = len(self.recorder.answers)
        if not success and request.num_computed_tokens == 0:
            self.kv.free(request.request_id)  # nothing was hit: admitted afresh, with no reservation of its own
            self.inflight_prefills.discard(request.request_id)
        else:
            self.kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1
        request.status = RequestStatus.WAITING

    def _advance(self, output: SchedulerOutput) -> dict[str, int]:
        """Count scheduled tokens as computed; with async scheduling add an output placeholder (SCHED-ASYNC-1)."""
        starts = {}
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            starts[request_id] = request.num_computed_tokens
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                self.inflight_prefills.discard(request_id)
            if self.config.async_scheduling and request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += 1
        return starts

    def _forward(self, output: SchedulerOutput, starts: dict[str, int]) -> tuple[dict[str, int], set[int]]:
        """Write each scheduled token's KV into its GPU block; sample at the sequence end (XFER-DATA-1, XFER-DATA-2)."""
        sampled: dict[str, int] = {}
        writes: set[int] = set()
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            tokens = runner_tokens(request, {} if self.in_flight is None else self.in_flight.sampled)
            start, end = starts[request_id], starts[request_id] + num_new
            states = request.token_states(end, tokens)
            blocks = output.block_ids[request_id]
            self.transfer.write_tokens(blocks, start, kv_content.kv_values(
                states[start:end], self.config.token_width, self.transfer.gpu.dtype))
            writes.update(blocks[start // self.config.block_size : -(-end // self.config.block_size)])
            if end == len(tokens):
                sampled[request_id] = kv_content.next_token(states[end - 1])
        return sampled, writes

    @staticmethod
    def reached_end(request: Request) -> bool:
        """Return True once a request has its `max_tokens` outputs: it finishes (LIFE-FIN-1)."""
        return len(request.output) >= request.max_tokens

    def _process(self, batch: Batch) -> None:
        """Apply a batch's sampled tokens and connector output (SCHED-STEP-1, CONN-STEP-4)."""
        if self.config.async_scheduling and batch.output.num_scheduled_tokens:
            self.processed_steps += 1
            while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_steps:
                self.kv.pool.free(reversed(self.deferred_frees.pop(0)[1]))  # LIFE-FREE-3
        for request_id, token in batch.sampled.items():
            request = self.requests[request_id]
            if request.is_finished:
                continue
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            request.append_output(token)  # also for a request preempted meanwhile (LIFE-PREEMPT-1)
            if self.config.async_scheduling and request.status is RequestStatus.RUNNING:
                # PFX-HIT-2
                self.kv.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
            if self.reached_end(request):
                (self.running if request in self.running else self.waiting).remove(request)
                self._finish(request, RequestStatus.FINISHED)
        update = self.connector.update_connector_output(batch.connector_output)
        for request_id in sorted(update.released & self.delayed_free):
            self.delayed_free.discard(request_id)
            self._step_reports.saves_finished.append(request_id)
            self._free(request_id)
        for request_id, success in update.loads_done.items():
            self._step_reports.loads_finished.append(request_id)
            if not success:
                self._step_reports.loads_failed.append(request_id)
            request = self.requests[request_id]
            if not request.is_finished:
                self.loads_done[request_id] = success
                if not success:  # LIFE-LOAD-3
                    request.num_computed_tokens = (request.num_local_hit_tokens
                                                   if self.config.local_hit_after_failed_load else 0)

    # --- observation helpers ------------------------------------------------------------

    def computed_kv(self, request_id: str) -> torch.Tensor:
        """Return the GPU KV rows of a request's computed tokens."""
        request = self.requests.get(request_id)
        if request is None:
            raise InvalidCall("CONF-OBS-2", f"unknown request id {request_id!r}")
        return self.transfer.read_tokens(self.kv.blocks_of(request_id), request.num_computed_tokens)

    def stored_kv(self, request_id: str, index: int) -> torch.Tensor:
        """Return the bytes the store holds for offloaded block `index` of a request, which must be readable."""
        request = self.requests.get(request_id)
        keys = self.connector.offload_keys(request) if request is not None else []
        block = self.manager.policy.get(keys[index]) if index < len(keys) else None
        if block is None or not block.is_ready:
            raise InvalidCall("CONF-OBS-2", f"offloaded block {index} of request {request_id!r} is not readable")
        return self.transfer.read_store(block.slot)

    def in_flight_job_count(self) -> int:
        """Return the jobs the connector still waits for (LIFE-LEAK-1)."""
        return len(self.connector.jobs)
