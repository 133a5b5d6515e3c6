"""The engine step loop: scheduler, KV-cache manager, connector, model runner (spec chapter `lifecycle`).

One `step()` is: schedule → connector metadata → worker flushes and loads → forward → worker stores
→ output processing (SCHED-STEP-1). With async scheduling one batch is in flight: the output processed
in step k is that of step k-1 (SCHED-ASYNC-1).

The engine schedules by its own policy, or follows a `FollowedSchedule`: the choices another engine's scheduler
made in the same step. Following, it runs its KV-cache manager, connector and store from those choices, so what
they must do is known for any schedule, and records what it could not follow (`refused`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvconform.common import kv_content
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.reference.connector import (
    NO_DEVIATIONS,
    ConnectorOutput,
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
    connector_output: ConnectorOutput


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
class StepResult:
    """What a step did, for the reference adapter to turn into a `StepObservation`."""

    scheduled_tokens: dict[str, int]
    computed_tokens: dict[str, int]
    trace: StepRecorder
    finished: list[str] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    forward_writes: set[int] = field(default_factory=set)
    store_reads_in_flight: set[int] = field(default_factory=set)
    reports: ConnectorReports = field(default_factory=ConnectorReports)
    preempted: set[str] = field(default_factory=set)


class Engine:
    """The reference engine: the spec's state machine, driven one step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device | None = None,
        *,
        kv: Callable[[int, int], KVCacheManager] = KVCacheManager,
        manager: Callable[[int, str], OffloadManager] = OffloadManager,
        connector: Callable[[OffloadManager, EngineConfig, StepRecorder], OffloadConnectorScheduler] = (
            OffloadConnectorScheduler),
        worker: Callable[[TransferEngine], OffloadConnectorWorker] = OffloadConnectorWorker,
    ) -> None:
        """Build the engine for `config` from its parts, each made by the factory of its name: the reference's
        classes, or a part a caller hands in instead (a mutant's)."""
        self.config = config
        self.kv = kv(config.num_gpu_blocks, config.block_size)
        self.recorder = StepRecorder()
        self.manager = manager(config.num_offload_blocks, config.eviction_policy)
        self.connector = connector(self.manager, config, self.recorder)
        self.transfer = TransferEngine(config.num_gpu_blocks, config.num_offload_blocks, config.block_size,
                                       config.block_size_factor, config.token_width, config.kv_dtype, device)
        self.worker = worker(self.transfer)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loads_done: dict[str, bool] = {}
        self.holders: dict[str, int] = {}
        """Waiting requests that hold GPU blocks, admitted with a load → when; considered first until they run."""
        self.load_order = itertools.count()
        self.resumed: list[str] = []
        """Block holders that the latest step ran (SCHED-ORDER-1)."""
        self.ready_holders: list[str] = []
        """Block holders whose load had ended when the latest step began admitting, taken up or not, in order
        (SCHED-ORDER-1)."""
        self.running_at_schedule: list[str] = []
        """The requests running when the latest step began scheduling, in order (SCHED-ORDER-1)."""
        self.refused: list[tuple[str, str]] = []
        """What the latest step's followed schedule asked that the free blocks did not allow: (clause, why)."""
        self.adopted: list[tuple[str, str]] = []
        """The known deviations of the followed engine the latest step took in place of its own choice: (clause, what)."""
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
        store take that engine's `deviations`."""
        scheduled: dict[str, int] = {}
        writes: set[int] = set()
        reads_in_flight: set[int] = set()
        preempted: set[str] = set()
        self.resumed, self.refused = [], []
        if self.has_work():
            preempted_before = set(self.preempted_since_schedule)
            output = self._schedule(followed, deviations)
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
        result = StepResult(scheduled, self._computed_tokens(), self.recorder.take(), self._step_finished,
                            self._step_freed, writes, reads_in_flight, self._step_reports, preempted)
        self._step_finished, self._step_freed, self._step_reports = [], [], ConnectorReports()
        self.adopted = result.trace.adopted
        return result

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

    def _schedule(self, followed: FollowedSchedule | None, deviations: KnownDeviations) -> SchedulerOutput:
        """Schedule running requests first, then waiting ones, within the token budget (SCHED-ORDER-1)."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        allocated: set[int] = set()
        first_run: set[int] = set()
        preempted = self.preempted_since_schedule
        self.preempted_since_schedule = set()
        self.running_at_schedule = [request.request_id for request in self.running]
        for request in list(self.running):
            if request not in self.running:
                continue
            num_new = (self._running_tokens(request, budget) if followed is None
                       else followed.scheduled_tokens.get(request.request_id, 0))
            if num_new == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, preempted, followed)
            if new_blocks is None:
                break
            allocated.update(new_blocks)
            scheduled[request.request_id] = num_new
            budget -= num_new
        if followed is not None:
            for request in [r for r in reversed(self.running) if r.request_id in followed.preempted]:
                self._preempt_victim(request, preempted)
        if followed is not None or not preempted:
            budget = self._schedule_waiting(budget, scheduled, allocated, first_run, followed, deviations)
        finished, self.finished_since_schedule = self.finished_since_schedule, []
        return SchedulerOutput(scheduled, {rid: self.requests[rid] for rid in scheduled},
                               {rid: list(self.kv.blocks_of(rid)) for rid in scheduled}, allocated, preempted, finished,
                               first_run)

    @staticmethod
    def _running_tokens(request: Request, budget: int) -> int:
        """Return the tokens the own policy schedules for a running request: all it has left, within the budget."""
        if len(request.output) + request.num_output_placeholders >= request.max_tokens:
            return 0
        return max(min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens, budget), 0)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str],
                             followed: FollowedSchedule | None) -> list[int] | None:
        """Allocate for a running request, preempting victims until it fits (SCHED-PREEMPT-1); following, the
        request must fit once the followed scheduler's victims are preempted."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, [], 0, delay_caching=False)
            if new_blocks is not None:
                return new_blocks
            victim = self._victim(request, followed)
            if victim is None:
                if followed is not None:
                    self.refused.append(("SCHED-ALLOC-1", f"{request.request_id!r} was scheduled {num_new} tokens, "
                                                          f"for which the free blocks do not hold"))
                return None
            self._preempt_victim(victim, preempted)
            if victim is request:
                return None

    def _victim(self, request: Request, followed: FollowedSchedule | None) -> Request | None:
        """Return the running request to preempt for `request`'s room: the newest one (SCHED-PREEMPT-1), itself if it
        is the newest; following, the newest of those the followed scheduler preempted, None when none is left."""
        if followed is None:
            return self.running[-1]
        return next((r for r in reversed(self.running) if r.request_id in followed.preempted), None)

    def _preempt_victim(self, victim: Request, preempted: set[str]) -> None:
        """Preempt a running request to make room in this step's scheduling (SCHED-PREEMPT-1)."""
        self._preempt(victim)
        preempted.add(victim.request_id)
        self.preempted_since_schedule.discard(victim.request_id)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int], allocated: set[int],
                          first_run: set[int], followed: FollowedSchedule | None, deviations: KnownDeviations) -> int:
        """Admit waiting requests: local hit, then the connector's external hit (CONN-MATCH-1, SCHED-ALLOC-1);
        following, those the followed scheduler considered, in its order, admitting those it admitted."""
        self.order_waiting()
        self.ready_holders = [request.request_id for request in self.waiting if request.request_id in self.holders
                              and (request.request_id in self.loads_done
                                   or request.status is not RequestStatus.WAITING_FOR_LOAD)]
        if followed is None:
            queue = list(self.waiting)
        else:
            waiting = {request.request_id: request for request in self.waiting}
            queue = [waiting[request_id] for request_id in followed.considered if request_id in waiting]
        for request in queue:
            if followed is None and budget == 0:
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
                answer, load_async = self.connector.get_num_new_matched_tokens(request, num_local, deviations)
                self.recorder.answers.append((request.request_id, num_local, answer, load_async))
                if answer is None:
                    continue  # asked again in a later step, keeping its place (SCHED-ORDER-1)
                num_external = answer
            num_computed = request.num_computed_tokens + num_local + num_external
            if followed is None:
                num_new = 0 if load_async else min(request.num_tokens - num_computed, budget)
            elif request.request_id in followed.admitted:
                num_new = 0 if load_async else followed.scheduled_tokens.get(request.request_id, 0)
            else:
                continue  # the followed scheduler left it waiting
            new_blocks = None
            # SCHED-ADMIT-1: the full sequence must fit, not only the first chunk
            if self.kv.holds_sequence(request, local_blocks):
                reserved = self._prefill_reservation() if load_async else 0
                new_blocks = self.kv.allocate_slots(request, num_new, local_blocks, num_external,
                                                    delay_caching=load_async, reserved=reserved)
            if new_blocks is None and followed is not None:
                self.refused.append(("SCHED-ADMIT-1", f"{request.request_id!r} was admitted, but the free blocks do "
                                                      f"not hold its full sequence ({request.num_tokens} tokens)"))
                continue
            if new_blocks is None:
                break
            allocated.update(new_blocks)
            first_run.update(local_blocks)
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
                self.resumed.append(request.request_id)
                first_run.update(self.kv.blocks_of(request.request_id))
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _prefill_reservation(self) -> int:
        """Return the blocks that in-flight prefills still need to hold their full sequence (SCHED-ADMIT-1)."""
        return sum(max(-(-self.requests[r].num_tokens // self.config.block_size) - len(self.kv.blocks_of(r)), 0)
                   for r in self.inflight_prefills)

    def order_waiting(self) -> None:
        """Put the waiting requests that hold GPU blocks first, in the order their loads were admitted; the others keep
        their queue order (SCHED-ORDER-1)."""
        self.waiting.sort(key=lambda request: (0, self.holders[request.request_id]) if request.request_id in self.holders
                          else (1, 0))

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

    def runner_tokens(self, request: Request) -> tuple[int, ...]:
        """Return the tokens as the model runner knows them: the scheduler's plus the one still in flight."""
        tokens = request.tokens
        if self.in_flight is not None:
            pending = self.in_flight.sampled.get(request.request_id)
            if pending is not None:
                tokens += (pending,)
        return tokens

    def _forward(self, output: SchedulerOutput, starts: dict[str, int]) -> tuple[dict[str, int], set[int]]:
        """Write each scheduled token's KV into its GPU block; sample at the sequence end (XFER-DATA-1, XFER-DATA-2)."""
        sampled: dict[str, int] = {}
        writes: set[int] = set()
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            tokens = self.runner_tokens(request)
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
                self.kv.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)  # PFX-HIT-2
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
