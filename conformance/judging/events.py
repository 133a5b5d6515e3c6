"""The events level's judge (chapter `kv-events`): what the engine publishes for KV-aware routers must agree with what
it serves.

The judge replays each step's batch of events (`StepObservation.kv_events`) into a router model (`router.Router`) and
judges it three ways: each event against the requests' own tokens, the hashes a router computes from them
(EVT-HASH-1, EVT-CHAIN-1); each lookup of the step against the router's prediction (EVT-ROUTE-1); and, for an adapter
that also reports its store (the offloading level), what the router holds on the CPU medium against the blocks the
store can serve at the end of the step (EVT-STORE-1, EVT-REMOVE-1, EVT-ONCE-1, EVT-TIME-1, EVT-CLEAR-1). It follows the
engine's own schedule and keeps no reference engine: requests' tokens come from the KV content function
(`reference.kv_history`), as at the connector level.

Checks of kind `events` judge a step's batch, in this order: the format, the stored blocks, the replay, the lookups;
checks of kind `event-store` judge the router against the store.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconform.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    parse_event,
)
from kvconform.common.values import (
    EngineConfig,
    MatchAnswer,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreSnapshot,
    TransferOutcome,
)
from kvconform.conformance.judging.judge import ClauseViolation, Run, check
from kvconform.conformance.judging.router import Router, RouterError
from kvconform.reference.hashing import block_hashes
from kvconform.reference.kv_history import KVHistory

Event = BlockStored | BlockRemoved | AllBlocksCleared

@dataclass
class EventsContext:
    """What the events checks consult: the config, the requests' block hashes, the router and the step's batch."""

    config: EngineConfig
    run: Run
    history: KVHistory = field(default_factory=KVHistory)
    hashes: dict[str, list[str]] = field(default_factory=dict)
    """Each request -> the hashes of every full block of its decoded sequence (PFX-HASH-1), as a router computes
    them."""
    blocks: dict[str, tuple[str | None, tuple[int, ...]]] = field(default_factory=dict)
    """Each block hash any request has -> its parent hash (None for a first block) and its tokens."""
    router: Router = field(default_factory=Router)
    step: int = 0
    batch: list[Event] = field(default_factory=list)
    """The step's events, parsed (EVT-FORMAT-1)."""
    views: dict[str, list[Router]] = field(default_factory=dict)
    """Each medium -> the router after each prefix of the step's events on it: where a lookup of the step may stand."""
    admitted: set[str] = field(default_factory=set)
    """Requests scheduled or given a load: from then on their tokens may have grown (EVT-ROUTE-1)."""
    reset_gpu: bool = False
    """A prefix-cache reset succeeded since the last step (EVT-CLEAR-1)."""
    reset_store: bool = False
    """A connector reset emptied the store since the last step (EVT-CLEAR-1)."""

    def add(self, spec: RequestSpec) -> None:
        """Learn a request's block hashes over its whole decoded sequence (XFER-DATA-2)."""
        self.history.add(spec.request_id, spec.prompt, spec.max_tokens, spec.cache_salt, spec.lora_name)
        tokens = self.history.requests[spec.request_id].decoded()
        hashes = [h.hex() for h in block_hashes(tokens, self.config.block_size, spec.lora_name, spec.cache_salt)]
        self.hashes[spec.request_id] = hashes
        size = self.config.block_size
        for index, block_hash in enumerate(hashes):
            parent = hashes[index - 1] if index else None
            self.blocks[block_hash] = (parent, tuple(tokens[index * size:(index + 1) * size]))

    def where(self, index: int) -> str:
        """Return how a verdict names event `index` of the step."""
        return f"step {self.step}, event {index} ({type(self.batch[index]).__name__})"

    def exercise(self, clause: str) -> None:
        self.run.coverage[clause] = self.run.coverage.get(clause, 0) + 1


# --- a step's batch (kind `events`) ------------------------------------------------------------------------------

@check("EVT-FORMAT-1", kind="events")
def check_event_format(ctx: EventsContext, observation: StepObservation) -> None:
    """Every published event is a BlockStored, BlockRemoved or AllBlocksCleared that parses."""
    ctx.batch = []
    for index, raw in enumerate(observation.kv_events):
        try:
            ctx.batch.append(parse_event(raw))
        except EventFormatError as error:
            raise ClauseViolation("EVT-FORMAT-1", f"step {ctx.step}, event {index}: {error}") from None
        ctx.exercise("EVT-FORMAT-1")


@check("EVT-HASH-1", "EVT-CHAIN-1", kind="events")
def check_stored_blocks(ctx: EventsContext, observation: StepObservation) -> None:
    """Each BlockStored names consecutive blocks of a request's sequence by the hashes a router computes from their
    tokens, cache salt and LoRA, chained on the block before."""
    size = ctx.config.block_size
    for index, event in enumerate(ctx.batch):
        if not isinstance(event, BlockStored):
            continue
        if event.block_size != size:
            raise ClauseViolation("EVT-HASH-1", f"{ctx.where(index)}: block_size {event.block_size}, the engine's is "
                                                f"{size}")
        parent = event.parent_block_hash
        for position, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[position * size:(position + 1) * size]
            known = ctx.blocks.get(block_hash)
            if known is None or known[1] != tokens:
                raise ClauseViolation("EVT-HASH-1", f"{ctx.where(index)}: hash {block_hash} of tokens {list(tokens)} "
                                                    "is no request's block hash (its tokens, cache salt and LoRA, "
                                                    "PFX-HASH-1): a router cannot match it")
            if known[0] != parent:
                raise ClauseViolation("EVT-CHAIN-1", f"{ctx.where(index)}: block {position} ({block_hash}) follows "
                                                     f"{known[0]}, but the event chains it on {parent}: the chain "
                                                     "is broken")
            parent = block_hash
        ctx.exercise("EVT-HASH-1")
        ctx.exercise("EVT-CHAIN-1")


@check("EVT-ORDER-1", "EVT-CLEAR-1", kind="events")
def check_replay(ctx: EventsContext, observation: StepObservation) -> None:
    """The router replays the batch in order: a removal withdraws an announced block, and after a prefix-cache reset
    the GPU medium is empty before anything is stored on it again."""
    ctx.views = {MEDIUM_GPU: [ctx.router.copy()], MEDIUM_CPU: [ctx.router.copy()]}
    clearing = ctx.reset_gpu
    for index, event in enumerate(ctx.batch):
        medium = MEDIUM_GPU if isinstance(event, AllBlocksCleared) else event.medium
        if clearing and medium == MEDIUM_GPU and isinstance(event, BlockStored):
            _cleared(ctx, f"before {ctx.where(index)}")
            clearing = False
        try:
            ctx.router.apply(event)
        except RouterError as error:
            raise ClauseViolation(error.clause, f"{ctx.where(index)}: {error}") from None
        ctx.views[medium].append(ctx.router.copy())
        ctx.exercise("EVT-ORDER-1")
    if clearing:
        _cleared(ctx, f"at the end of step {ctx.step}")
    ctx.reset_gpu = False


def _cleared(ctx: EventsContext, when: str) -> None:
    held = sorted(ctx.router.counts[MEDIUM_GPU])
    if held:
        raise ClauseViolation("EVT-CLEAR-1", f"the prefix cache was reset, yet {when} the router still holds "
                                             f"{len(held)} GPU block(s), {held[0]} first: no AllBlocksCleared")
    ctx.exercise("EVT-CLEAR-1")


@check("EVT-ROUTE-1", kind="events")
def check_router_predicts_hits(ctx: EventsContext, observation: StepObservation) -> None:
    """The router predicts each lookup: every block of a served hit is announced on its medium, and a request not
    admitted yet is served as much local hit as the router holds."""
    at = {MEDIUM_GPU: 0, MEDIUM_CPU: 0}
    for answer in observation.match_answers:
        spec = ctx.run.requests.get(answer.request_id)
        if spec is not None and answer.request_id in ctx.hashes:
            _predict(ctx, answer, spec, at)
            ctx.exercise("EVT-ROUTE-1")
    ctx.admitted |= set(observation.scheduled_tokens) | {load.request_id for load in observation.loads}


def _predict(ctx: EventsContext, answer: MatchAnswer, spec: RequestSpec, at: dict[str, int]) -> None:
    """Judge one lookup against the router's views of the step, from the prefixes `at` which the lookups before it
    stood at, and move them on; tally the router's figures (EVT-ROUTE-1)."""
    size, factor = ctx.config.block_size, ctx.config.block_size_factor
    hashes = ctx.hashes[answer.request_id]
    served = answer.local_hit_tokens // size
    exact = not spec.skip_reading_prefix_cache and answer.request_id not in ctx.admitted
    cap = (len(spec.prompt) - 1) // size

    def local(view: Router) -> int:
        held = view.run_held(MEDIUM_GPU, hashes)
        return min(held, cap) if exact else held

    at[MEDIUM_GPU] = _stand(ctx, MEDIUM_GPU, at[MEDIUM_GPU],
                            lambda view: local(view) == served if exact else local(view) >= served,
                            lambda view: f"{answer.request_id!r} was served a local hit of {served} block(s); the "
                                         f"router predicts {local(view)} from what step {ctx.step} had announced on "
                                         "GPU")
    predicted = local(ctx.views[MEDIUM_GPU][at[MEDIUM_GPU]])
    external = answer.external_tokens or 0
    if external > 0:
        first = answer.local_hit_tokens // (size * factor) * factor
        last = -(-(answer.local_hit_tokens + external) // (size * factor)) * factor
        needed = min(last, len(hashes)) - first

        def offloaded(view: Router) -> int:
            return view.run_held(MEDIUM_CPU, hashes, first)

        at[MEDIUM_CPU] = _stand(ctx, MEDIUM_CPU, at[MEDIUM_CPU], lambda view: offloaded(view) >= needed,
                                lambda view: f"{answer.request_id!r} was served {external} external token(s), blocks "
                                             f"{first}..{first + needed - 1}; the router holds {offloaded(view)} of "
                                             "them on CPU")
        served += needed
        predicted += min(offloaded(ctx.views[MEDIUM_CPU][at[MEDIUM_CPU]]), needed)
    ctx.run.tally("router_lookups", 1)
    ctx.run.tally("router_blocks_served", served)
    ctx.run.tally("router_blocks_predicted", predicted)


def _stand(ctx: EventsContext, medium: str, start: int, fits: Any, why: Any) -> int:
    """Return the first prefix of the step's events on `medium`, from `start` on, after which the router's view fits
    a lookup: lookups and events happen in one order, so successive lookups stand at later prefixes (EVT-ROUTE-1)."""
    views = ctx.views[medium]
    for index in range(start, len(views)):
        if fits(views[index]):
            return index
    raise ClauseViolation("EVT-ROUTE-1", why(views[start]))


# --- the router against the store (kind `event-store`) ---------------------------------------------------------

@check("EVT-STORE-1", "EVT-ONCE-1", "EVT-TIME-1", "EVT-REMOVE-1", "EVT-CLEAR-1", kind="event-store")
def check_store_announced(ctx: EventsContext, store: StoreSnapshot) -> None:
    """At the end of a step the router holds on CPU exactly the blocks the store can serve, each announced once: a
    GPU-block hash as often as the readable offloaded blocks it is part of."""
    factor = ctx.config.block_size_factor
    counts = ctx.router.counts[MEDIUM_CPU]

    def hashes_of(refs: frozenset) -> list[tuple[str, str]]:
        return [(h, f"{ref.request_id}[{ref.index}]") for ref in sorted(refs, key=repr)
                for h in ctx.hashes.get(ref.request_id, [])[ref.index * factor:(ref.index + 1) * factor]]

    ready, storing = hashes_of(store.ready), dict(hashes_of(store.storing))
    expected = Counter(h for h, _ in ready)
    for block_hash, block in ready:
        if counts[block_hash] < expected[block_hash]:
            raise ClauseViolation("EVT-STORE-1", f"after step {ctx.step} the store can serve offloaded block {block} "
                                                 f"(hash {block_hash} in it), which the router does not hold on CPU: "
                                                 "a silent block")
        if counts[block_hash] > expected[block_hash]:
            raise ClauseViolation("EVT-ONCE-1", f"after step {ctx.step} hash {block_hash} of offloaded block {block} "
                                                f"is announced {counts[block_hash]} times on CPU, held in "
                                                f"{expected[block_hash]} offloaded block(s)")
    for block_hash in sorted(set(counts) - set(expected)):
        if block_hash in storing:
            raise ClauseViolation("EVT-TIME-1", f"after step {ctx.step} block {storing[block_hash]} (hash "
                                                f"{block_hash}) is announced on CPU while its store is in flight")
        clause, cause = (("EVT-CLEAR-1", "the connector reset emptied the store and never announced it")
                         if ctx.reset_store else ("EVT-REMOVE-1", "its removal was never announced"))
        raise ClauseViolation(clause, f"after step {ctx.step} hash {block_hash} is announced on CPU but the store "
                                      f"cannot serve it: {cause}")
    for clause in ("EVT-STORE-1", "EVT-ONCE-1", "EVT-TIME-1", "EVT-REMOVE-1"):
        ctx.exercise(clause)
    if ctx.reset_store:
        ctx.exercise("EVT-CLEAR-1")
    ctx.reset_store = False


class EventsJudge:
    """Judges one execution's KV events with a router model, on the engine's own schedule (chapter `kv-events`)."""

    def __init__(self, run: Run, config: EngineConfig) -> None:
        self.run = run
        self.ctx = EventsContext(config, run)

    def add_request(self, spec: RequestSpec) -> None:
        self.ctx.add(spec)

    def prefill(self, spec: RequestSpec) -> None:
        self.ctx.add(spec)

    def decode(self, spec: RequestSpec, params: dict[str, Any]) -> None:
        self.ctx.add(spec)

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Nothing to follow: a transfer's outcome shows in the events and the store of the step that reports it."""

    def abort(self, request_id: str) -> None:
        """Nothing to follow: a freed request's blocks show in the events."""

    def preempt(self, request_id: str) -> None:
        """Nothing to follow: a preempted request's blocks show in the events."""

    def step_observed(self, observation: StepObservation, completed_in_step: TransferOutcome | None) -> None:
        """Replay the step's events and judge them, then the router against the store if the adapter reports it."""
        self.ctx.step += 1
        self.run.judge("adapter.step()", "events", self.ctx, observation)
        if "offloading" in self.run.capabilities.levels:
            self.run.judge("adapter.store_contents()", "event-store", self.ctx, self.run.call("store_contents"))

    def resident_kv(self, request_id: str, kv: torch.Tensor) -> None:
        """Nothing to judge: the bytes are the other levels'."""

    def reset_answered(self, reset_connector: bool, answer: bool) -> None:
        """Expect the reset announced in the next step's batch (EVT-CLEAR-1)."""
        self.ctx.reset_gpu |= answer
        self.ctx.reset_store |= reset_connector

    def drained(self, usage: ResourceUsage, waited: str) -> None:
        """Nothing more to judge: every step's events were judged."""

    # --- where the requests are: the events level follows none (judge.EngineState); the deeper levels do ----------

    def unfinished(self) -> list[str]:
        return []

    def loading(self) -> list[str]:
        return []

    def running(self) -> list[str]:
        return []

    def storing(self) -> list[str]:
        return []

    def stores_in_flight(self) -> bool:
        return False

    def transfers_pending(self) -> bool:
        return False

    def resident(self) -> list[str]:
        return []

    def busy(self) -> bool:
        return False

    def idle(self, usage: ResourceUsage) -> bool:
        return True

