"""The connector level's judge: any KVConnectorBase_V1, judged on the engine's own schedule (chapter `connector-level`).

The judge never decides which request runs. It reads each step the adapter reports — scheduled tokens,
computed tokens, the connector's answers, load and save reports, finishes and frees — as input, keeps the
history of KV the engine computed (`reference.kv_history.KVHistory`) and the protocol state of each request
(`ScheduleTrace`), and checks what must hold whatever the schedule: answers in range, hits only for KV
computed before in the same tenant, every byte right, every async load reported once, delayed frees honoured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconform.common.values import (
    EngineConfig,
    MatchAnswer,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance.judging.judge import ClauseViolation, Run, check
from kvconform.reference.kv_history import KVHistory


@dataclass
class ScheduleTrace:
    """The adapter's schedule as its observations tell it: which requests are where in their lifecycle."""

    unfinished: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    """Requests the latest step scheduled that have not finished."""
    loads: dict[str, int] = field(default_factory=dict)
    """Requests whose latest answer offered external tokens → the computed tokens the load would complete."""
    loading: set[str] = field(default_factory=set)
    """Requests whose asynchronous load was admitted and not reported finished yet (KVC-ASYNC-1)."""
    loaded: set[str] = field(default_factory=set)
    """Requests whose load was reported finished, successfully, in the latest step."""
    delayed: set[str] = field(default_factory=set)
    """Finished requests whose free the connector delayed and has not ended yet (KVC-FREE-1)."""
    in_flight: bool = False
    """The latest step scheduled tokens: with async scheduling its output is still to be processed."""
    computed_tokens: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    """Steps judged so far; the step being judged is `steps + 1`."""
    load_story: dict[str, str] = field(default_factory=dict)
    """Each request's latest load, admission and report, in words, for the messages about its bytes (KVC-DATA-1)."""
    preempted_at: dict[str, int] = field(default_factory=dict)
    """The step of each request's latest preemption."""


@dataclass
class ConnectorJudge:
    """Judges one execution at the connector level, following the adapter's own schedule (`judge.Judge`)."""

    run: Run
    config: EngineConfig
    history: KVHistory = field(default_factory=KVHistory)
    trace: ScheduleTrace = field(default_factory=ScheduleTrace)

    @property
    def requests(self) -> Mapping[str, RequestSpec]:
        """The requests the harness added, by id."""
        return self.run.requests

    def exercise(self, clause: str) -> None:
        exercised = self.run.coverage
        exercised[clause] = exercised.get(clause, 0) + 1

    # --- the operations, before the adapter runs them ------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Track a request the harness added: it is unfinished until the adapter reports it finished."""
        self.history.add(spec.request_id, spec.prompt, spec.max_tokens, spec.cache_salt, spec.lora_name)
        self.trace.unfinished.add(spec.request_id)

    def prefill(self, spec: RequestSpec) -> None:
        """A request to a pair's producer is, at this level, a request like any other."""
        self.add_request(spec)

    def decode(self, spec: RequestSpec, params: dict[str, Any]) -> None:
        """A request to a pair's consumer is, at this level, a request like any other."""
        self.add_request(spec)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Nothing to follow: the adapter reports what its transfers did in its next step."""

    def abort(self, request_id: str) -> None:
        """An aborted request finishes at once; its load, if any, is still to be reported (KVC-ASYNC-1)."""
        self.trace.unfinished.discard(request_id)
        self.trace.running.discard(request_id)

    def preempt(self, request_id: str) -> None:
        self.trace.running.discard(request_id)
        self.trace.preempted_at[request_id] = self.trace.steps

    def admitted_loads(self, observation: StepObservation) -> set[str]:
        """Return the requests whose asynchronous load the step admitted: answered with a load and left waiting with
        the hit counted as computed, or with the load reported failed in that step (its request then counts its local
        hit only). vLLM accepts its report from that very step on (`_update_from_kv_xfer_finished`)."""
        return {answer.request_id for answer in observation.match_answers
                if answer.load_async and answer.external_tokens and answer.external_tokens > 0
                and (observation.computed_tokens.get(answer.request_id) == answer.local_hit_tokens
                     + answer.external_tokens or answer.request_id in observation.loads_failed)}

    def offered_loads(self, observation: StepObservation) -> dict[str, int]:
        """Return the requests with a load offered, before this step or in it -> the computed tokens it would reach."""
        offered = dict(self.trace.loads)
        for answer in observation.match_answers:
            if answer.external_tokens and answer.external_tokens > 0:
                offered[answer.request_id] = answer.local_hit_tokens + answer.external_tokens
        return offered

    def story(self, request_id: str) -> str:
        """Return what led to a request's bytes: its latest load and the preemption before it, in words."""
        parts = [self.trace.load_story[request_id]] if request_id in self.trace.load_story else ["no load"]
        if request_id in self.trace.preempted_at:
            parts.append(f"preempted in step {self.trace.preempted_at[request_id]}")
        return "; ".join(parts)

    # --- the adapter's answers -------------------------------------------------------------------------------

    def step_observed(self, observation: StepObservation, completed_in_step: TransferOutcome | None) -> None:
        """Judge a step's answers and reports, then follow it; when its transfers completed is the adapter's own
        business at this level."""
        self.run.judge("adapter.step()", "connector", self, observation)
        self.follow(observation)

    def resident_kv(self, request_id: str, kv: torch.Tensor) -> None:
        """Judge a request's GPU bytes against the KV the engine computed for its prefix (KVC-DATA-1)."""
        self.run.judge(f"adapter.computed_kv({request_id!r})", "connector-data", self, request_id, kv)

    def reset_answered(self, reset_connector: bool, answer: bool) -> None:
        """Nothing to judge: whether a prefix-cache reset may be refused is the offloading level's (PFX-RESET-1)."""

    def drained(self, usage: ResourceUsage, waited: str) -> None:
        """Judge the drained engine: every load reported, every request finished, nothing held."""
        self.run.judge("adapter.resource_usage()", "connector-drain", self, usage, waited)

    # --- where the requests are, as the adapter's own schedule has it (judge.EngineState) ----------------

    def unfinished(self) -> list[str]:
        return sorted(self.trace.unfinished)

    def loading(self) -> list[str]:
        return sorted(self.trace.loading & self.trace.unfinished)

    def running(self) -> list[str]:
        return sorted(self.trace.running)

    def storing(self) -> list[str]:
        """Return no request: which requests a connector is still saving is its own business at this level."""
        return []

    def stores_in_flight(self) -> bool:
        """Return False: which saves a connector has in flight is its own business at this level."""
        return False

    def transfers_pending(self) -> bool:
        """Return True while a load is in flight or a free is delayed: the transfers this level can see."""
        return bool(self.trace.loading or self.trace.delayed)

    def busy(self) -> bool:
        """Return True while the adapter may still have work for a step: a request, a delayed free, a load, an
        output."""
        trace = self.trace
        return bool(trace.unfinished or trace.delayed or trace.loading or trace.in_flight)

    def resident(self) -> list[str]:
        """Return the requests whose computed tokens' KV must be in their GPU blocks now: running or just loaded."""
        return sorted((self.trace.running | self.trace.loaded) & self.trace.unfinished)

    def idle(self, usage: ResourceUsage) -> bool:
        """Return True once the adapter holds nothing: on its own schedule only it knows its pending saves."""
        return not any(usage.model_dump().values())

    def follow(self, observation: StepObservation) -> None:
        """Advance the trace and the KV history past a judged step."""
        trace = self.trace
        trace.steps += 1
        for request_id, output in observation.output_tokens.items():
            self.history.sampled(request_id, output)
        finished = set(observation.finished)
        trace.unfinished -= finished
        trace.delayed = (trace.delayed | set(observation.free_delayed)) - set(observation.saves_finished)
        answers = {answer.request_id: answer for answer in observation.match_answers}  # each request's latest
        admitted = self.admitted_loads(observation)
        for request_id, answer in answers.items():
            tokens = answer.external_tokens
            trace.loading.discard(request_id)
            trace.loads.pop(request_id, None)
            if tokens and tokens > 0:
                trace.loads[request_id] = answer.local_hit_tokens + tokens
                trace.load_story[request_id] = (
                    f"tokens {answer.local_hit_tokens}-{trace.loads[request_id]} loaded "
                    + (f"asynchronously, admitted in step {trace.steps}" if request_id in admitted else
                       f"synchronously in step {trace.steps}"))
        for request_id in observation.preempted:
            trace.preempted_at[request_id] = trace.steps
        for request_id in observation.loads_finished:
            if request_id in trace.load_story:
                trace.load_story[request_id] += f", reported finished in step {trace.steps}"
        # a load reported in the step that admitted it ends there too: the admission comes first
        trace.loading = (trace.loading | admitted) - set(observation.loads_finished)
        trace.loaded = set(observation.loads_finished) - set(observation.loads_failed)
        for request_id, num_new in observation.scheduled_tokens.items():
            self.history.record_computed(request_id, self._start_of_step(answers.get(request_id), request_id) + num_new)
        for request_id in trace.loaded & observation.computed_tokens.keys():
            self.history.record_computed(request_id, observation.computed_tokens[request_id])
        trace.running = set(observation.scheduled_tokens) - finished
        trace.in_flight = bool(observation.scheduled_tokens)
        trace.computed_tokens = dict(observation.computed_tokens)

    def _start_of_step(self, answer: MatchAnswer | None, request_id: str) -> int:
        """Return the tokens a scheduled request had computed before the step: its hit if admitted in it with this
        `answer` (a synchronous load included), else what the previous step left (a finishing request's is gone)."""
        if answer is None:
            return self.trace.computed_tokens.get(request_id, 0)
        return answer.local_hit_tokens + (answer.external_tokens or 0) * (not answer.load_async)


# --- each step's answers and reports ---------------------------------------------------------------


def answer_fault(judge: ConnectorJudge, answer: MatchAnswer) -> ClauseViolation | None:
    """Return what is wrong with an answer by itself: out of range (KVC-MATCH-1), or offered to a request that must
    not read cached KV (KVC-SKIP-1)."""
    tokens, request_id = answer.external_tokens, answer.request_id
    if tokens is None:
        return None
    bound = judge.history.requests[request_id].max_kv_tokens
    if tokens < 0 or answer.local_hit_tokens + tokens > bound or (answer.load_async and not tokens):
        return ClauseViolation("KVC-MATCH-1", f"request {request_id!r}: answered ({tokens}, {answer.load_async}) after "
                                              f"a local hit of {answer.local_hit_tokens}; the request has at most "
                                              f"{bound} tokens with KV")
    if not answer.load_async and tokens and answer.num_tokens is not None and (
            answer.local_hit_tokens + tokens >= answer.num_tokens):
        return ClauseViolation("KVC-MATCH-1", f"request {request_id!r}: answered a synchronous load of {tokens} "
                                              f"after a local hit of {answer.local_hit_tokens}, covering all of its "
                                              f"{answer.num_tokens} tokens: none is left to compute")
    if judge.requests[request_id].skip_reading_prefix_cache and (tokens or answer.load_async):
        return ClauseViolation("KVC-SKIP-1", f"request {request_id!r} must not read cached KV, yet the connector "
                                             f"answered ({tokens}, {answer.load_async})")
    return None


MASKED_FAULTS: dict[str, tuple[Callable[[ConnectorJudge, MatchAnswer], bool], str]] = {
    "negative count": (lambda judge, answer: (answer.external_tokens or 0) < 0,
                       "every release read (vLLM 0.28-0.34: Scheduler.schedule never checks the count's sign), "
                       "with either load mode"),
    "synchronous hit of every token": (
        lambda judge, answer: not answer.load_async and bool(answer.external_tokens) and answer.num_tokens is not None
        and answer.local_hit_tokens + (answer.external_tokens or 0) >= answer.num_tokens,
        "every release read, synchronous loads only (vLLM 0.23-0.34: Scheduler.schedule asserts num_new_tokens > 0 "
        "and recomputes the last token of an asynchronous load's full hit only, `_update_waiting_for_remote_kv`)"),
    "skip-read answered": (lambda judge, answer: judge.requests[answer.request_id].skip_reading_prefix_cache,
                           "releases whose Scheduler.schedule takes a skip-read request's answer as given "
                           "(`skip_read_condition` is None: vLLM 0.23, 0.24, 0.28, 0.30; 0.32-0.34 replace it), with "
                           "either load mode"),
}
"""Each kind of masked fault, by name: how to tell it from the connector's own answer, and the releases and load modes
where it fails, as read in their code (KVC-MATCH-1, KVC-SKIP-1); the first kind that fits is named."""


def record_masked(judge: ConnectorJudge, answer: MatchAnswer, fault: ClauseViolation) -> None:
    """Keep the fault of an answer the engine's scheduler replaced before using it as a finding, not a failure: this
    release masks it; the finding names where it fails, from `MASKED_FAULTS`."""
    kind, (_, fails_on) = next(((kind, row) for kind, row in MASKED_FAULTS.items() if row[0](judge, answer)),
                               ("fault", (None, "releases that take the connector's answer as given")))
    judge.run.finding(fault.clause, f"{fault.detail}; masked by this release's scheduler, which replaced the answer "
                                    f"before using it; as a {kind} it fails on {fails_on}")


def judge_answers(judge: ConnectorJudge, observation: StepObservation, clause: str,
                  judged: Callable[[MatchAnswer], bool]) -> None:
    """Raise the first fault of `clause` among the answers the engine took that `judged` selects; record those of the
    answers its scheduler replaced as findings (`record_masked`)."""
    for answer in observation.match_answers:
        if judged(answer):
            judge.exercise(clause)
            fault = answer_fault(judge, answer)
            if fault is not None and fault.clause == clause:
                raise fault
    for answer in observation.masked_answers:
        fault = answer_fault(judge, answer)
        if fault is not None and fault.clause == clause:
            record_masked(judge, answer, fault)


@check("KVC-MATCH-1", kind="connector")
def check_answer_range(judge: ConnectorJudge, observation: StepObservation) -> None:
    """Every answer is None or a non-negative count within the request's tokens, asynchronous only when not 0, and a
    synchronous load leaves a token to compute; one the scheduler replaced is judged as the connector gave it, a
    finding (`record_masked`)."""
    judge_answers(judge, observation, "KVC-MATCH-1", lambda answer: True)


@check("KVC-SKIP-1", kind="connector")
def check_skip_read_black_box(judge: ConnectorJudge, observation: StepObservation) -> None:
    """A request that must not read cached KV gets no external tokens and so no load; an answer the scheduler replaced
    is judged as the connector gave it, a finding (`record_masked`)."""
    judge_answers(judge, observation, "KVC-SKIP-1",
                  lambda answer: judge.requests[answer.request_id].skip_reading_prefix_cache)


@check("KVC-HIT-1", kind="connector")
def check_hits_were_computed(judge: ConnectorJudge, observation: StepObservation) -> None:
    """A hit covers only a prefix whose KV the engine computed before, in the request's tenant."""
    for answer in observation.match_answers:
        if not answer.external_tokens or answer.external_tokens < 0:
            continue
        judge.exercise("KVC-HIT-1")
        covered = answer.local_hit_tokens + answer.external_tokens
        if covered <= judge.history.requests[answer.request_id].max_kv_tokens and not judge.history.was_computed(
                answer.request_id, covered):
            spec = judge.requests[answer.request_id]
            raise ClauseViolation("KVC-HIT-1", f"request {answer.request_id!r}: the connector offers the KV of its "
                                               f"first {covered} tokens, which no request of tenant (cache_salt="
                                               f"{spec.cache_salt!r}, lora_name={spec.lora_name!r}) has computed")


@check("KVC-ASYNC-1", kind="connector")
def check_async_loads(judge: ConnectorJudge, observation: StepObservation) -> None:
    """Each admitted asynchronous load is reported finished exactly once, before its request runs."""
    loading = judge.trace.loading | judge.admitted_loads(observation)  # vLLM accepts a report in the admitting step
    for request_id in observation.loads_finished:
        judge.exercise("KVC-ASYNC-1")
        if request_id not in loading:
            raise ClauseViolation("KVC-ASYNC-1", f"the connector reported a load of request {request_id!r} finished, "
                                                 "but no load of it was in flight (reported twice, or never started)")
    unreported = sorted(set(observation.scheduled_tokens) & loading - set(observation.loads_finished))
    if unreported:
        raise ClauseViolation("KVC-ASYNC-1", f"request(s) {unreported} ran while their asynchronous load was not "
                                             "reported finished")


@check("KVC-FAIL-1", kind="connector")
def check_load_failures(judge: ConnectorJudge, observation: StepObservation) -> None:
    """A failed load is reported only for a request with a load; the tokens it failed to bring are then recomputed."""
    offered = judge.offered_loads(observation)
    if observation.loads_failed and "fails_load" in judge.run.capabilities.never:
        raise ClauseViolation("KVC-FAIL-1", f"the connector reported failed loads of {list(observation.loads_failed)}, "
                                            "though its manifest declares that it never fails a load (never: "
                                            "fails_load)")
    for request_id in observation.loads_failed:
        judge.exercise("KVC-FAIL-1")
        if request_id not in offered:
            raise ClauseViolation("KVC-FAIL-1", f"the connector reported a failed load for request {request_id!r}, "
                                                "which was offered no external tokens")
        end, computed = offered[request_id], observation.computed_tokens.get(request_id, 0)
        if request_id in observation.computed_tokens and computed >= end:
            raise ClauseViolation("KVC-FAIL-1", f"request {request_id!r}: its load failed, yet it still counts all "
                                                f"{computed} tokens the load was to complete as computed: what failed "
                                                "is never recomputed")


@check("KVC-FREE-1", kind="connector")
def check_delayed_frees(judge: ConnectorJudge, observation: StepObservation) -> None:
    """Blocks whose free the connector delayed are freed when it ends the delay, not before; ends only its own."""
    delayed = judge.trace.delayed | set(observation.free_delayed)
    released, freed = set(observation.saves_finished), set(observation.freed)
    if observation.free_delayed or released:
        judge.exercise("KVC-FREE-1")
    if observation.free_delayed and "delays_free" in judge.run.capabilities.never:
        raise ClauseViolation("KVC-FREE-1", f"the connector delayed the free of {list(observation.free_delayed)}, "
                                            "though its manifest declares that it never delays a free (never: "
                                            "delays_free)")
    strangers = sorted(released - delayed)
    if strangers:
        raise ClauseViolation("KVC-FREE-1", f"the connector ended the delayed free of {strangers}, whose frees it "
                                            "never delayed")
    early = sorted(freed & delayed - released)
    if early:
        raise ClauseViolation("KVC-FREE-1", f"request(s) {early} freed while the connector still holds their blocks "
                                            "(request_finished answered delay_free=True and no save has finished)")
    kept = sorted(released - freed)
    if kept:
        raise ClauseViolation("KVC-FREE-1", f"the connector released request(s) {kept}, but their blocks were not "
                                            "freed")


# --- bytes ----------------------------------------------------------------------------------------------


@check("KVC-DATA-1", kind="connector-data")
def check_resident_bytes(judge: ConnectorJudge, request_id: str, kv: torch.Tensor) -> None:
    """The GPU bytes of a running or just loaded request's computed tokens are the KV of that prefix in its tenant."""
    judge.exercise("KVC-DATA-1")
    num_tokens = judge.trace.computed_tokens.get(request_id, 0)
    expected = judge.history.expected_kv(request_id, num_tokens, judge.config.token_width, kv.dtype)
    if kv.shape == expected.shape and torch.equal(kv, expected):
        return
    wrong: object = f"all (shape {tuple(kv.shape)}, expected {tuple(expected.shape)})"
    heads, ranks = "", judge.config.tensor_parallel_size
    if kv.shape == expected.shape:
        differ = kv != expected
        wrong = differ.any(dim=1).nonzero().flatten().tolist()
        if ranks > 1:
            heads = f"; the heads of rank(s) {[r for r, part in enumerate(differ.chunk(ranks, dim=1)) if part.any()]}"
    raise ClauseViolation("KVC-DATA-1", f"request {request_id!r}: KV bytes of token positions {wrong} are not what the "
                                        "engine computed for that prefix in the request's tenant (step "
                                        f"{judge.trace.steps}; {judge.story(request_id)}{heads})")


# --- once the engine is drained --------------------------------------------------------------------------


@check("KVC-ASYNC-1", "KVC-LIVE-1", "KVC-LEAK-1", kind="connector-drain")
def check_connector_drained(judge: ConnectorJudge, usage: ResourceUsage, waited: str) -> None:
    """Once transfers may complete, every load is reported, every request finished, nothing held; `waited` says how
    long the drain waited for it."""
    judge.exercise("KVC-LIVE-1")
    judge.exercise("KVC-LEAK-1")
    if judge.trace.loading:
        raise ClauseViolation("KVC-ASYNC-1", f"the loads of {sorted(judge.trace.loading)} were never reported finished "
                                             f"after {waited}")
    if usage.unfinished_requests or judge.trace.unfinished:
        raise ClauseViolation("KVC-LIVE-1", f"request(s) {sorted(judge.trace.unfinished)} still unfinished after "
                                            f"{waited}")
    leaks = {name: value for name, value in usage.model_dump().items() if value}
    if judge.trace.delayed:
        leaks["delayed_frees"] = sorted(judge.trace.delayed)
    if leaks:
        raise ClauseViolation("KVC-LEAK-1", f"the engine still holds {leaks} after {waited}")
