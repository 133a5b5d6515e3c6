"""The offloading level's checks: each compares one observation of the adapter under test with the reference engine's,
or checks an absolute rule, and names the clause it enforces (chapters 01 – 06; `offloading.OffloadingJudge` runs them).

Their kinds: `step` (a step), `store` (the store's contents), `data` (a request's GPU bytes), `stored-data` (the bytes
a completed store made readable), `reset` (the answer to a prefix-cache reset), `drain` (the drained engine).
Checks of a kind run in the order they are registered: absolute rules first,
then differential comparisons — the connector's lookups and answers for the requests both engines asked,
then the schedule and the finishes, then what follows from them (computed tokens, loads, store offers
and writes, evictions, frees) — so a failure names the clause of its cause rather than of a consequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kvconform.common import kv_content
from kvconform.common.values import (
    BlockRef,
    EngineConfig,
    LoadJob,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreJob,
    StoreSnapshot,
)
from kvconform.conformance.judging.judge import ClauseViolation, check
from kvconform.reference.engine import FollowedSchedule, StepFacts
from kvconform.reference.kv_cache import NULL_BLOCK_ID
from kvconform.reference.request import Request, RequestStatus

JobName = tuple[bool, str, tuple[int, ...]]
"""A transfer job as observations name it: (is a store, request, offloaded blocks). No two jobs in flight share a
name: a request has one load at a time, and a store writes only blocks the store does not hold (OFF-MGR-5)."""


@dataclass
class Context:
    """What the offloading level's checks may consult besides the two observations: the config, the requests as
    added and as the reference engine models them, and the facts of the reference's latest step."""

    config: EngineConfig
    requests: Mapping[str, RequestSpec]
    reference_requests: Mapping[str, Request]
    """The requests as the reference engine stepped alongside models them: their tokens and block hashes."""
    facts: StepFacts = field(default_factory=StepFacts)
    """What the reference's latest step did that its observation does not show (`reference.engine.StepFacts`)."""
    followed: FollowedSchedule | None = None
    """The adapter's scheduling choices in the step being judged, which the reference followed; set by each step."""
    previous_store: StoreSnapshot = field(default_factory=lambda: StoreSnapshot(ready=frozenset(), storing=frozenset()))
    previous_pinned: frozenset[bytes] = frozenset()
    """The blocks, by identity, that loads still read at the end of the previous step (OFF-MGR-3)."""
    exercised: dict[str, int] = field(default_factory=dict)
    kv_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    hashes: dict[BlockRef, bytes] = field(default_factory=dict)
    jobs_in_flight: Counter[JobName] = field(default_factory=Counter)
    """The adapter's transfer jobs created and not yet reported finished (CONN-STEP-4)."""

    @property
    def followed_schedule(self) -> FollowedSchedule:
        """Return the adapter's scheduling choices that the reference followed in the step being judged."""
        if self.followed is None:
            raise RuntimeError("no followed schedule: a step's checks run after the reference followed the step")
        return self.followed

    def identity(self, ref: BlockRef) -> bytes:
        """Return the block hash that a `BlockRef` stands for (CONF-OBS-2); a request's hashes never change."""
        known = self.hashes.get(ref)
        if known is not None:
            return known
        request = self.reference_requests.get(ref.request_id)
        position = (ref.index + 1) * self.config.block_size_factor - 1
        if request is None or position >= len(request.block_hashes):
            raise ClauseViolation("CONF-OBS-2", f"{ref!r} names no full offloaded block of a known request")
        self.hashes[ref] = request.block_hashes[position]
        return self.hashes[ref]

    def identities(self, refs: Iterable[BlockRef]) -> set[bytes]:
        return {self.identity(ref) for ref in refs}

    def exercise(self, clause: str) -> None:
        self.exercised[clause] = self.exercised.get(clause, 0) + 1

    def expected_kv(self, request: Request, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """Return the KV rows the content function gives a request's first `num_tokens` tokens (XFER-DATA-1).

        A request's tokens only ever grow, so the rows of earlier steps are kept and extended.
        """
        rows = self.kv_rows.get(request.request_id, torch.empty(0, self.config.token_width, dtype=dtype))
        if len(rows) < num_tokens:
            states = request.token_states(num_tokens, self.facts.runner_tokens(request))
            rows = torch.cat([rows, kv_content.kv_values(states[len(rows):], self.config.token_width, dtype)])
            self.kv_rows[request.request_id] = rows
        return rows[:num_tokens]


def _differ(clause: str, what: str, ref: object, sut: object) -> None:
    if ref != sut:
        raise ClauseViolation(clause, f"{what}: reference {ref!r}, adapter {sut!r}")


def _differ_blocks(ctx: Context, clause: str, what: str, ref: Iterable[BlockRef], sut: Iterable[BlockRef]) -> None:
    """Compare two sets of offloaded blocks by identity (CONF-OBS-2); a difference names the blocks only one side
    has, each as that side named it."""
    ref_blocks, sut_blocks = ctx.identities(ref), ctx.identities(sut)
    if ref_blocks != sut_blocks:
        only_ref = sorted(f"{b.request_id}[{b.index}]" for b in ref if ctx.identity(b) not in sut_blocks)
        only_sut = sorted(f"{b.request_id}[{b.index}]" for b in sut if ctx.identity(b) not in ref_blocks)
        raise ClauseViolation(clause, f"{what}: the reference's alone {only_ref}, the adapter's alone {only_sut} "
                                      "(request[offloaded block])")


def _asked_by_both(ref: StepObservation, sut: StepObservation) -> set[str]:
    return {a.request_id for a in ref.match_answers} & {a.request_id for a in sut.match_answers}


def _answers(observation: StepObservation, asked: set[str]) -> dict[str, tuple[int, int | None, bool]]:
    """Return the (local hit, external tokens, async) answered to each of the `asked` requests."""
    return {a.request_id: (a.local_hit_tokens, a.external_tokens, a.load_async)
            for a in observation.match_answers if a.request_id in asked}


def _local_hits(observation: StepObservation, asked: set[str]) -> dict[str, int]:
    """Return the local hit each of the `asked` requests was asked with."""
    return {a.request_id: a.local_hit_tokens for a in observation.match_answers if a.request_id in asked}


def _loads(observation: StepObservation) -> dict[str, list[tuple[tuple[int, ...], int, int]]]:
    """Return each request's load jobs as (offloaded blocks, first GPU block, GPU blocks), in a stable order."""
    loads: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}
    for load in observation.loads:
        loads.setdefault(load.request_id, []).append((load.offload_indices, load.first_gpu_block, load.num_gpu_blocks))
    return {request_id: sorted(jobs) for request_id, jobs in loads.items()}


def _by_request(jobs: Iterable) -> dict[str, list[tuple[int, ...]]]:
    grouped: dict[str, list[tuple[int, ...]]] = {}
    for job in jobs:
        grouped.setdefault(job.request_id, []).append(tuple(job.offload_indices))
    return grouped


# --- absolute rules on the adapter's own observation ------------------------------------------


@check("CONF-OBS-2", kind="step")
def check_block_refs(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every BlockRef the adapter reports names a full offloaded block of a request the harness added."""
    refs = [*sut.evicted, *(evicted for offer in sut.store_offers for evicted in offer.evicted), *sut.touches,
            *(BlockRef(request_id=job.request_id, index=index) for job in sut.completed_stores
              for index in job.offload_indices)]
    if refs:
        ctx.exercise("CONF-OBS-2")
    ctx.identities(refs)


@check("PFX-NULL-1", kind="step")
def check_null_block_unused(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The forward never writes the null block, physical block 0: it is never handed to a request."""
    if sut.forward_writes:
        ctx.exercise("PFX-NULL-1")
    if NULL_BLOCK_ID in sut.forward_writes:
        raise ClauseViolation("PFX-NULL-1", f"the forward wrote GPU blocks {sorted(sut.forward_writes)}, the null "
                                            f"block {NULL_BLOCK_ID} among them: it was handed to a request")


@check("CONN-MATCH-2", "CONN-MATCH-3", kind="step")
def check_match_answer_shape(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A 0-token answer is synchronous; local plus external hit never exceeds the request's tokens."""
    for answer in sut.match_answers:
        ctx.exercise("CONN-MATCH-2")
        if answer.external_tokens == 0 and answer.load_async:
            raise ClauseViolation("CONN-MATCH-2", f"{answer!r}: a 0-token answer must have load_async=False")
        total = ctx.reference_requests[answer.request_id].num_tokens
        ctx.exercise("CONN-MATCH-3")
        if answer.external_tokens is not None and answer.local_hit_tokens + answer.external_tokens > total:
            raise ClauseViolation("CONN-MATCH-3", f"{answer!r} exceeds the request's {total} tokens")


@check("OFF-READ-1", "OFF-READ-2", kind="step")
def check_skip_read(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A skip-read request is never looked up, reports 0 tokens and gets no load."""
    skipping = {rid for rid, spec in ctx.requests.items() if spec.skip_reading_prefix_cache}
    for request_id in skipping & set(sut.lookups):
        raise ClauseViolation("OFF-READ-1", f"request {request_id!r} skips reading cached KV but the store was "
                                            f"looked up for offloaded blocks {sut.lookups[request_id]}")
    for answer in sut.match_answers:
        if answer.request_id in skipping:
            ctx.exercise("OFF-READ-1")
            ctx.exercise("OFF-READ-2")
            if answer.external_tokens not in (0, None) or answer.load_async:
                raise ClauseViolation("OFF-READ-2", f"skip-read request answered {answer!r}; expected 0 tokens, sync")
    for load in sut.loads:
        if load.request_id in skipping:
            raise ClauseViolation("OFF-READ-2", f"skip-read request got a load {load!r}")


@check("LIFE-LOAD-1", kind="step")
def check_loads_taken_up(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A waiting request is taken up from its load (its loaded blocks cached) only once the load is reported
    finished: the reference, following the adapter's order, takes up exactly the loads the adapter took up."""
    if not sut.promoted and not ref.promoted:
        return
    ctx.exercise("LIFE-LOAD-1")
    early = [request_id for request_id in sut.promoted if request_id not in ref.promoted]
    if early:
        raise ClauseViolation("LIFE-LOAD-1", f"took up {early} from their loads, but no load of theirs was reported "
                                             "finished: their blocks were cached before their KV was loaded")
    missed = [request_id for request_id in ref.promoted if request_id not in sut.promoted]
    if missed:
        raise ClauseViolation("LIFE-LOAD-1", f"considered {missed} after their loads were reported finished, but did "
                                             "not take them up (promoted)")


@check("PFX-HIT-3", "LIFE-LOAD-2", kind="step")
def check_last_token_computed(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every scheduled request computes at least one token: neither a local hit nor a finished load covers the last.

    A request the reference runs in this step after waiting for its load is judged by LIFE-LOAD-2, any other by
    PFX-HIT-3.
    """
    loaded = set(ctx.facts.resumed)
    for request_id, num_tokens in sut.scheduled_tokens.items():
        clause = "LIFE-LOAD-2" if request_id in loaded else "PFX-HIT-3"
        ctx.exercise(clause)
        if num_tokens < 1:
            cover = "its finished load" if clause == "LIFE-LOAD-2" else "its hit"
            raise ClauseViolation(clause, f"request {request_id!r} was scheduled {num_tokens} tokens: {cover} "
                                          "covered every token, so the last one was never recomputed")


@check("CONN-LOAD-2", kind="step")
def check_no_redundant_load(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A load never targets GPU blocks the local prefix cache already hit."""
    local = {a.request_id: a.local_hit_tokens for a in sut.match_answers}
    for load in sut.loads:
        ctx.exercise("CONN-LOAD-2")
        hit_blocks = local.get(load.request_id, 0) // ctx.config.block_size
        if load.first_gpu_block < hit_blocks:
            raise ClauseViolation("CONN-LOAD-2",
                                  f"{load!r} reloads GPU blocks below the local hit of {hit_blocks} blocks")


@check("OFF-KEY-2", kind="step")
def check_loads_read_own_blocks(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A load reads only blocks the store held readable under the loading request's own identity (tenant included)."""
    if not sut.loads:
        return
    held = ctx.identities(ctx.previous_store.ready)
    for load in sut.loads:
        ctx.exercise("OFF-KEY-2")
        foreign = [i for i in load.offload_indices
                   if ctx.identity(BlockRef(request_id=load.request_id, index=i)) not in held]
        if foreign:
            raise ClauseViolation("OFF-KEY-2", f"{load!r} reads offloaded blocks {foreign}, which the store did not "
                                               "hold for this request's prefix and tenant (cache_salt, LoRA)")


@check("XFER-SAFE-1", kind="step")
def check_no_overwrite_in_flight(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The forward never writes a GPU block that an in-flight store still reads."""
    if sut.store_reads_in_flight:
        ctx.exercise("XFER-SAFE-1")
    clash = sut.forward_writes & sut.store_reads_in_flight
    if clash:
        raise ClauseViolation("XFER-SAFE-1", f"forward wrote GPU blocks {sorted(clash)} while stores still read them")


@check("OFF-MGR-7", kind="step")
def check_kept_keys_not_evicted(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """prepare_store never evicts a block it was offered and already held.

    With each offer's own evictions reported, each prepare_store call is judged on its own. Otherwise it is
    decided in steps with one store offer, whose prepare_store call made every eviction of the step; with
    several, an eviction cannot be told apart from one made for a later offer.
    """
    if any(offer.evicted for offer in sut.store_offers):
        held = ctx.identities(ctx.previous_store.ready)
        for offer in sut.store_offers:
            _judge_kept_keys(ctx, offer, held, offer.evicted)
    elif len(sut.store_offers) == 1 and sut.evicted:
        _judge_kept_keys(ctx, sut.store_offers[0], ctx.identities(ctx.previous_store.ready), sut.evicted)


def _judge_kept_keys(ctx: Context, offer: StoreJob, held: set[bytes], evicted: tuple[BlockRef, ...]) -> None:
    """OFF-MGR-7 for one prepare_store call: `offer` and the blocks `evicted` while it was prepared."""
    ctx.exercise("OFF-MGR-7")
    kept = ctx.identities(BlockRef(request_id=offer.request_id, index=i) for i in offer.offload_indices)
    lost = kept & held & ctx.identities(evicted)
    if lost:
        raise ClauseViolation("OFF-MGR-7", f"evicted {len(lost)} block(s) of {offer!r}, which it offered and the "
                                           f"store already held: evicted {evicted}")


@check("OFF-MGR-3", kind="step")
def check_pinned_not_evicted(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The store never evicts a block a load still reads: one pinned at the end of the previous step, or by a load of
    this step (prepare_store runs after the step's scheduling created its loads, before their completions)."""
    evicted = list(dict.fromkeys([*sut.evicted, *(block for offer in sut.store_offers for block in offer.evicted)]))
    if not evicted:
        return
    ctx.exercise("OFF-MGR-3")
    loading = ctx.identities(BlockRef(request_id=load.request_id, index=index)
                             for load in sut.loads for index in load.offload_indices)
    pinned = ctx.identities(evicted) & (ctx.previous_pinned | loading)
    if pinned:
        raise ClauseViolation("OFF-MGR-3", f"evicted {len(pinned)} block(s) that a load still reads (pinned): "
                                           f"evicted {evicted}")


@check("OFF-STORE-2", kind="step")
def check_stores_were_offered(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every block written to the store was offered for that request in the same step."""
    offered = {(o.request_id, i) for o in sut.store_offers for i in o.offload_indices}
    for store in sut.stores:
        ctx.exercise("OFF-STORE-2")
        extra = [i for i in store.offload_indices if (store.request_id, i) not in offered]
        if extra:
            raise ClauseViolation("OFF-STORE-2", f"{store!r} writes blocks {extra} that were never offered")


# --- differential comparisons: the connector's lookups and answers, the schedule, then its consequences


@check("SCHED-PREEMPT-1", kind="step")
def check_preemption_victims(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The scheduler preempts the most recently admitted running requests: those it preempted are the last ones
    running when the step began."""
    if not sut.preempted:
        return
    ctx.exercise("SCHED-PREEMPT-1")
    running = ctx.facts.running_at_schedule
    newest = running[len(running) - len(sut.preempted):]
    if set(sut.preempted) != set(newest):
        raise ClauseViolation("SCHED-PREEMPT-1", f"preempted {sorted(sut.preempted)}, where the newest running "
                                                 f"requests are {newest} (running in the order {running})")


@check("SCHED-ALLOC-1", "SCHED-ADMIT-1", kind="step")
def check_schedule_held(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every request the adapter scheduled or admitted had its blocks in the free pool: the reference, scheduling
    alike, could allocate them; an admission, for the request's full sequence."""
    if sut.scheduled_tokens:
        ctx.exercise("SCHED-ALLOC-1")
    if ctx.followed_schedule.admitted:
        ctx.exercise("SCHED-ADMIT-1")
    for clause, why in ctx.facts.refused:
        raise ClauseViolation(clause, why)


@check("SCHED-ORDER-1", kind="step")
def check_running_first(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Running requests are scheduled before waiting ones, and no waiting request is admitted in a step that
    preempted one."""
    running = set(ctx.facts.running_at_schedule)
    scheduled = list(sut.scheduled_tokens)
    admitted = sorted(ctx.followed_schedule.admitted)
    if running and admitted:
        ctx.exercise("SCHED-ORDER-1")
    first_waiting = next((position for position, r in enumerate(scheduled) if r not in running), len(scheduled))
    late = [r for r in scheduled[first_waiting:] if r in running]
    if late:
        raise ClauseViolation("SCHED-ORDER-1", f"running requests {late} were scheduled after waiting ones: "
                                               f"scheduled in the order {scheduled}")
    if sut.preempted and admitted:
        raise ClauseViolation("SCHED-ORDER-1", f"admitted {admitted} in a step that preempted {list(sut.preempted)}")


@check("SCHED-ORDER-1", kind="step")
def check_block_holders_first(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A waiting request that holds GPU blocks and whose load has ended comes before every other waiting request:
    the adapter runs it before it considers another, or, if it cannot, considers no other in that step.

    Left behind a request that cannot fit while it holds the blocks that one needs, neither could ever run.
    """
    ready = ctx.facts.ready_holders
    considered = list(ctx.followed_schedule.considered)
    others = [r for r in considered if r not in ready]
    if not ready or not others:
        return
    ctx.exercise("SCHED-ORDER-1")
    ahead = considered[: considered.index(others[0])]
    passed_over = [r for r in ready if r not in ahead]
    if passed_over:
        raise ClauseViolation("SCHED-ORDER-1", f"{passed_over} waited holding GPU blocks until their loads ended, so "
                                               f"they come before every other waiting request, but the adapter "
                                               f"considered {others[0]!r} first (considered {considered})")


@check("PFX-HIT-1", kind="step")
def check_local_hits(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Each request both engines asked was given the reference's local hit: the prefix cache's part of the answer.

    Judged before the lookups and the connector's answer, which both start where the local hit ends.
    """
    asked = _asked_by_both(ref, sut)
    if asked:
        ctx.exercise("PFX-HIT-1")
    _differ("PFX-HIT-1", "local hits (tokens the GPU prefix cache held)", _local_hits(ref, asked),
            _local_hits(sut, asked))


@check("CONN-MATCH-4", "OFF-LOOKUP-3", "OFF-LOOKUP-4", kind="step")
def check_deferrals(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A request the reference defers (None) is deferred: while it has transfers in flight (asked without a lookup),
    while a block of its hit is being stored, or while one is being loaded for another request.

    Judged before the lookups and answers: a missing deferral shows there first, and this names its cause.
    """
    asked = _asked_by_both(ref, sut)
    expected, actual = _answers(ref, asked), _answers(sut, asked)
    storing = ctx.identities(ctx.previous_store.storing)
    for request_id in sorted(r for r, (_, tokens, _) in expected.items() if tokens is None):
        looked_up = ref.lookups.get(request_id, ())
        if not looked_up:
            clause, cause = "CONN-MATCH-4", "it still has transfer jobs in flight"
        elif ctx.identities(BlockRef(request_id=request_id, index=i) for i in looked_up) & storing:
            clause, cause = "OFF-LOOKUP-3", "a block of its hit is still being stored"
        else:
            clause, cause = "OFF-LOOKUP-4", "a block of its hit is being loaded for another request"
        ctx.exercise(clause)
        if actual[request_id][1] is not None:
            raise ClauseViolation(clause, f"request {request_id!r}: {cause}, so it must be answered None (ask again "
                                          f"later); the adapter answered {actual[request_id][1]} external tokens")


@check("OFF-LOOKUP-1", "OFF-LOOKUP-2", kind="step")
def check_lookups(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The store is looked up from the first block past the local hit, in order, up to the first miss."""
    for request_id in sorted((set(ref.lookups) | set(sut.lookups)) & _asked_by_both(ref, sut)):
        expected, actual = ref.lookups.get(request_id, ()), sut.lookups.get(request_id, ())
        ctx.exercise("OFF-LOOKUP-1")
        ctx.exercise("OFF-LOOKUP-2")
        if expected and actual[: len(expected)] == expected and len(actual) > len(expected):
            raise ClauseViolation("OFF-LOOKUP-2", f"request {request_id!r}: lookups went on past the first miss at "
                                                  f"block {expected[-1]}: looked up {actual}")
        _differ("OFF-LOOKUP-1", f"offloaded blocks looked up for {request_id!r}", expected, actual)


@check("CONN-MATCH-1", kind="step")
def check_match_answers(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """get_num_new_matched_tokens gives the reference's answers (local hit, external tokens, async flag).

    Only requests both engines asked are compared: which requests are asked is the scheduler's choice (SCHED-STEP-2).
    """
    asked = _asked_by_both(ref, sut)
    if asked:
        ctx.exercise("CONN-MATCH-1")
    _differ("CONN-MATCH-1", "matched-token answers (local hit, external tokens, async)", _answers(ref, asked),
            _answers(sut, asked))


@check("SCHED-STEP-2", kind="step")
def check_schedule(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """A step schedules only unfinished requests and no more tokens than its budget, and asks for matches exactly
    the waiting requests the reference, considering the same ones, asks: those with no computed tokens."""
    ctx.exercise("SCHED-STEP-2")
    unknown = sorted(set(sut.scheduled_tokens) - set(ref.computed_tokens) - set(ref.finished))
    if unknown:
        raise ClauseViolation("SCHED-STEP-2", f"scheduled tokens for {unknown}, which are no unfinished requests: "
                                              f"{sut.scheduled_tokens}")
    total = sum(sut.scheduled_tokens.values())
    if total > ctx.config.max_num_batched_tokens:
        raise ClauseViolation("SCHED-STEP-2", f"scheduled {total} tokens, over the step's budget of "
                                              f"{ctx.config.max_num_batched_tokens}: {sut.scheduled_tokens}")
    _differ("SCHED-STEP-2", "requests asked for matched tokens", sorted(a.request_id for a in ref.match_answers),
            sorted(a.request_id for a in sut.match_answers))


@check("LIFE-FIN-1", kind="step")
def check_finished(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Requests finish in the step the reference finishes them."""
    if ref.finished:
        ctx.exercise("LIFE-FIN-1")
    _differ("LIFE-FIN-1", "finished requests", sorted(ref.finished), sorted(sut.finished))


@check("SCHED-STEP-2", kind="step")
def check_computed_tokens(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Each unfinished request ends the step with the reference's computed tokens (after the finishes are known)."""
    _differ("SCHED-STEP-2", "computed tokens after the step", ref.computed_tokens, sut.computed_tokens)


@check("OFF-READ-3", kind="step")
def check_skip_read_still_stores(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every block the reference offers to the store for a skip-read request, the adapter offers in the same step.

    Only missing offers break the rule: that the offers match exactly, skip-read or not, is OFF-STORE-1's.
    """
    skipping = {rid for rid, spec in ctx.requests.items() if spec.skip_reading_prefix_cache}
    sut_offers = _by_request(sut.store_offers)
    for request_id, jobs in _by_request(ref.store_offers).items():
        if request_id not in skipping:
            continue
        ctx.exercise("OFF-READ-3")
        offered = {i for job in sut_offers.get(request_id, []) for i in job}
        missing = sorted({i for job in jobs for i in job} - offered)
        if missing:
            raise ClauseViolation("OFF-READ-3", f"skip-read request {request_id!r}: its computed blocks {missing} "
                                                f"were not offered to the store (reference offers {jobs}, adapter "
                                                f"{sut_offers.get(request_id, [])})")


@check("XFER-LOAD-2", kind="step")
def check_loads(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Load jobs cover the reference's offloaded blocks and GPU block range."""
    if ref.loads:
        ctx.exercise("XFER-LOAD-2")
    _differ("XFER-LOAD-2", "load jobs (offloaded blocks, first GPU block, GPU blocks)", _loads(ref), _loads(sut))


@check("OFF-STORE-1", kind="step")
def check_store_offers(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every newly full, computed offloaded block is offered to the store in the step the reference does."""
    if ref.store_offers:
        ctx.exercise("OFF-STORE-1")
    ref_offers, sut_offers = _by_request(ref.store_offers), _by_request(sut.store_offers)
    if ref_offers != sut_offers:
        differing = {r for r in {*ref_offers, *sut_offers} if ref_offers.get(r) != sut_offers.get(r)}
        at_finish = sorted(r for r in differing if _finished_unscheduled(ctx, sut, r))
        raise ClauseViolation("OFF-STORE-1", f"blocks offered to the store: reference {ref_offers!r}, adapter "
                                             f"{sut_offers!r}" + "".join(f" (offered at finish: {r})"
                                                                         for r in at_finish))


def _finished_unscheduled(ctx: Context, sut: StepObservation, request_id: str) -> bool:
    """Return whether `request_id` has finished and is not scheduled in the step: its offers are those made at its
    finish (OFF-STORE-6), so a known failure can tell that cause from another of OFF-STORE-1 by the message."""
    request = ctx.reference_requests.get(request_id)
    return (request_id not in sut.scheduled_tokens and request is not None
            and request.status in (RequestStatus.FINISHED, RequestStatus.ABORTED))


@check("OFF-LRU-1", "OFF-ARC-1", kind="step")
def check_evictions(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The store evicts the blocks the configured policy (LRU or ARC) picks."""
    clause = "OFF-LRU-1" if ctx.config.eviction_policy == "lru" else "OFF-ARC-1"
    if ref.evicted:
        ctx.exercise(clause)
    _differ_blocks(ctx, clause, "evicted blocks", ref.evicted, sut.evicted)


@check("OFF-STORE-3", kind="step")
def check_store_writes(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """The store writes exactly the offered blocks it does not already hold."""
    if ref.stores:
        ctx.exercise("OFF-STORE-3")
    _differ("OFF-STORE-3", "blocks written to the store", _by_request(ref.stores), _by_request(sut.stores))


@check("LIFE-FREE-1", kind="step")
def check_freed(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Finished requests' GPU blocks are released in the step the reference releases them, and not before."""
    if ref.freed:
        ctx.exercise("LIFE-FREE-1")
    _differ("LIFE-FREE-1", "requests whose GPU blocks were released", sorted(ref.freed), sorted(sut.freed))


# --- store contents and data -------------------------------------------------------------------


@check("OFF-MGR-1", kind="store")
def check_store_contents(ctx: Context, ref: StoreSnapshot, sut: StoreSnapshot) -> None:
    """The store holds the reference's blocks, each readable or still being stored as in the reference."""
    ctx.exercise("OFF-MGR-1")
    if sut == ref:  # the same names stand for the same blocks: only snapshots named otherwise need their identities
        return
    _differ_blocks(ctx, "OFF-MGR-1", "readable store blocks", ref.ready, sut.ready)
    _differ_blocks(ctx, "OFF-MGR-1", "blocks being stored", ref.storing, sut.storing)


@check("XFER-DATA-1", kind="data")
def check_computed_bytes(ctx: Context, request_id: str, kv: torch.Tensor) -> None:
    """The GPU bytes of a running or just loaded request's computed tokens equal the KV content function's."""
    request = ctx.reference_requests[request_id]
    ctx.exercise("XFER-DATA-1")
    _judge_bytes("XFER-DATA-1", f"request {request_id!r}", kv,
                 ctx.expected_kv(request, request.num_computed_tokens, kv.dtype),
                 "what the forward wrote for that prefix (corrupt, stale or misplaced load)")


def _judge_bytes(clause: str, what: str, kv: torch.Tensor, expected: torch.Tensor, cause: str, first: int = 0) -> None:
    """Fail `clause` unless the KV rows `kv` of `what`, for the token positions from `first` on, equal `expected`."""
    if kv.shape != expected.shape:
        raise ClauseViolation(clause, f"{what}: KV of shape {tuple(kv.shape)}, expected {tuple(expected.shape)}")
    if not torch.equal(kv, expected):
        wrong = [first + row for row in (kv != expected).any(dim=1).nonzero().flatten().tolist()]
        raise ClauseViolation(clause, f"{what}: KV bytes of token positions {wrong[:8]} differ from {cause}")


@check("PFX-RESET-1", kind="reset")
def check_reset_answer(ctx: Context, ref: bool, sut: bool) -> None:
    """reset_prefix_cache gives the reference's answer: refused while a GPU block is used, done otherwise."""
    ctx.exercise("PFX-RESET-1")
    _differ("PFX-RESET-1", "answer of reset_prefix_cache", ref, sut)


# --- once the engine is drained ----------------------------------------------------------------


@check("LIFE-LIVE-1", "LIFE-LEAK-1", kind="drain")
def check_drained(ctx: Context, usage: ResourceUsage, waited: str) -> None:
    """Once transfers complete and no request is left, nothing stays allocated, pinned or in flight."""
    ctx.exercise("LIFE-LEAK-1")
    ctx.exercise("LIFE-LIVE-1")
    if usage.unfinished_requests:
        raise ClauseViolation("LIFE-LIVE-1", f"{usage.unfinished_requests} request(s) still unfinished after "
                                             f"{waited}")
    leaks = {name: value for name, value in usage.model_dump().items() if value}
    if leaks:
        raise ClauseViolation("LIFE-LEAK-1", f"engine idle but still holds {leaks}")


# --- data at rest and job accounting ------------------------------------------------------------


@check("XFER-DATA-3", kind="stored-data")
def check_stored_bytes(ctx: Context, block: BlockRef, kv: torch.Tensor) -> None:
    """The bytes a completed store left readable are the KV of the block's tokens in the storing request's tenant."""
    ctx.exercise("XFER-DATA-3")
    size = ctx.config.block_size * ctx.config.block_size_factor
    first = block.index * size
    expected = ctx.expected_kv(ctx.reference_requests[block.request_id], first + size, kv.dtype)[first:]
    _judge_bytes("XFER-DATA-3", f"{block!r}, as the store holds it", kv, expected,
                 "the KV of that prefix in the request's tenant (a corrupt, stale or misplaced store)", first)


def _job_names(loads: Iterable[LoadJob], stores: Iterable[StoreJob]) -> list[JobName]:
    return [(False, job.request_id, job.offload_indices) for job in loads] + [
        (True, job.request_id, job.offload_indices) for job in stores]


def _describe(job: JobName) -> str:
    is_store, request_id, indices = job
    return f"the {'store' if is_store else 'load'} job of request {request_id!r}, offloaded blocks {list(indices)}"


@check("CONN-STEP-4", kind="step")
def check_jobs_reported_once(ctx: Context, ref: StepObservation, sut: StepObservation) -> None:
    """Every job reported finished is one the adapter created and has not reported finished before.

    The step's new jobs count before its completions: a job may finish in the step that creates it.
    """
    in_flight = ctx.jobs_in_flight
    in_flight.update(_job_names(sut.loads, sut.stores))
    for job in _job_names(sut.completed_loads, sut.completed_stores):
        ctx.exercise("CONN-STEP-4")
        if not in_flight[job]:
            raise ClauseViolation("CONN-STEP-4", f"{_describe(job)} was reported finished, but no such job was in "
                                                 "flight: reported twice, or never created")
        in_flight[job] -= 1
        if not in_flight[job]:
            del in_flight[job]


@check("CONN-STEP-4", kind="drain")
def check_jobs_all_reported(ctx: Context, usage: ResourceUsage, waited: str) -> None:
    """Once drained, every job the adapter created has been reported finished (or discarded by a connector reset)."""
    ctx.exercise("CONN-STEP-4")
    if ctx.jobs_in_flight:
        unreported = "; ".join(map(_describe, sorted(ctx.jobs_in_flight)))
        raise ClauseViolation("CONN-STEP-4", f"after {waited}, never reported "
                                             f"finished: {unreported}")

