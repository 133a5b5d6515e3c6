"""Unit tests of the reference for the clauses the conformance state machine cannot observe.

Each test's docstring names the clause it tests; spec chapters list these tests as their checks.
"""

from __future__ import annotations

import importlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from hypothesis.errors import InvalidArgument
from pydantic import ValidationError

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common import kv_content
from kvconform.common.values import BlockRef, Capabilities, EngineConfig, RequestSpec, StepObservation
from kvconform.conformance import runner
from kvconform.conformance.execution import Call, Execution, Session
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.judging.offloading_checks import Context
from kvconform.conformance.machine import engine_configs
from kvconform.conformance.profiles import PROFILES, Profile
from kvconform.reference.connector import (
    ConnectorMetadata,
    ConnectorOutput,
    OffloadConnectorScheduler,
    OffloadConnectorWorker,
    SchedulerOutput,
    TransferJob,
)
from kvconform.reference.engine import Engine, FollowedSchedule
from kvconform.reference.errors import InvalidCall
from kvconform.reference.hashing import NONE_HASH, block_hashes, extra_keys, hash_block
from kvconform.reference.kv_cache import BlockPool, KVCacheManager
from kvconform.reference.offload_manager import ARCPolicy, LRUPolicy, OffloadManager
from kvconform.reference.recorder import StepRecorder
from kvconform.reference.request import Request, RequestStatus
from kvconform.reference.transfer import TransferEngine

CPU = torch.device("cpu")
PROMPT = tuple((i * 7 + 3) % 4 for i in range(12))
"""Three GPU blocks of 4 tokens; with block_size_factor 1 also three offloaded blocks."""
K = [bytes([i]) * 16 for i in range(8)]
"""Offload keys for manager-level tests."""


def req(request_id: str = "r", prompt: tuple[int, ...] = PROMPT, **kw) -> Request:
    return Request(request_id, prompt, kw.pop("max_tokens", 1), 4, **kw)


def stored(manager: OffloadManager, *keys: bytes) -> None:
    """Store `keys` successfully."""
    manager.prepare_store(list(keys))
    manager.complete_store(list(keys), success=True)


@pytest.fixture
def engine():
    def make(**kw) -> Engine:
        return Engine(EngineConfig(**{"block_size_factor": 1, "num_gpu_blocks": 16, **kw}), CPU)
    return make


def prime(e: Engine) -> Engine:
    """Put PROMPT's 3 blocks in the store; reset the GPU prefix cache, then let it hold PROMPT's block 0 only."""
    e.add_request(RequestSpec(request_id="r0", prompt=PROMPT))
    e.step()
    e.complete_transfers(False, False)
    e.step()
    assert e.reset_prefix_cache()
    e.add_request(RequestSpec(request_id="ra", prompt=PROMPT[:5], skip_reading_prefix_cache=True))
    e.step()
    return e


def admit_with_load(e: Engine) -> Engine:
    """`prime` the engine, then admit r1 (PROMPT) with a local hit of 4 tokens and an async load of 8."""
    prime(e).add_request(RequestSpec(request_id="r1", prompt=PROMPT, max_tokens=2))
    assert e.step().trace.loads == [("r1", [1, 2], 1, 2)]
    return e


@pytest.fixture
def primed(engine) -> Engine:
    return prime(engine())


@pytest.fixture
def loading(engine) -> Engine:
    return admit_with_load(engine())


@pytest.fixture
def conn():
    def make(slots: int = 8, factor: int = 1, policy: str = "lru") -> OffloadConnectorScheduler:
        return OffloadConnectorScheduler(OffloadManager(slots, policy),
                                         EngineConfig(block_size=4, block_size_factor=factor), StepRecorder())
    return make


def drain(e: Engine) -> None:
    """Complete every transfer and step until the engine is idle, its batch in flight processed."""
    while e.has_work() or e.in_flight is not None:
        e.complete_transfers(False, False)
        e.step()


def offloaded_then_forgotten(e: Engine, prompt: tuple[int, ...]) -> None:
    """Let a request "writer" compute and offload `prompt`, then reset the GPU prefix cache: only the store has it."""
    e.add_request(RequestSpec(request_id="writer", prompt=prompt))
    drain(e)
    assert e.reset_prefix_cache()


def sched_output(request: Request, num_tokens: int, blocks: list[int], allocated=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput({request.request_id: num_tokens}, {request.request_id: request},
                           {request.request_id: blocks}, set(allocated), set(preempted))


# --- prefix cache -------------------------------------------------------------------------------


def test_hash_chain_depends_on_every_earlier_block():
    """PFX-HASH-1: block hashes chain on the parent, starting from NONE_HASH; partial blocks are not hashed."""
    hashes = block_hashes(PROMPT + (1, 2), 4)
    assert len(hashes) == 3 and hashes[0] == hash_block(NONE_HASH, PROMPT[:4], ())
    assert hashes[1] == hash_block(hashes[0], PROMPT[4:8], ())
    changed = block_hashes((PROMPT[0] + 1,) + PROMPT[1:], 4)
    assert all(a != b for a, b in zip(hashes, changed, strict=True))


def test_extra_keys_lora_every_block_salt_block_zero():
    """PFX-HASH-2: the LoRA name is an extra key of every block, the cache salt of block 0 only."""
    assert extra_keys("x", "s", 0) == ("lora:x", "salt:s")
    assert extra_keys("x", "s", 1) == ("lora:x",)
    assert extra_keys(None, "s", 1) == ()
    plain, salted = block_hashes(PROMPT, 4), block_hashes(PROMPT, 4, cache_salt="s")
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def test_null_block_never_allocated():
    """PFX-NULL-1: block 0 is never handed out, and a pool needs at least two blocks."""
    pool = BlockPool(4)
    assert pool.allocate(3) == [1, 2, 3] and pool.num_free_blocks == 0
    with pytest.raises(InvalidCall):
        BlockPool(1)


def test_ref_counts():
    """PFX-REF-1: allocate sets a ref count of 1, touch adds one, free drops one; freeing at 0 is invalid."""
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert pool.ref_counts[block] == 2
    pool.free([block, block])
    assert pool.ref_counts[block] == 0 and block in pool.free_queue
    with pytest.raises(InvalidCall):
        pool.free([block])


def test_local_hit_stops_at_first_miss_and_skip_flag_gives_none():
    """PFX-HIT-1: the local hit is the run of cached blocks from block 0; a skip-read request gets none."""
    kv = KVCacheManager(16, 4)
    first = req("a")
    kv.allocate_slots(first, 12, [], 0, delay_caching=False)
    kv.pool._uncache(kv.blocks_of("a")[1])
    assert kv.get_computed_blocks(req("b", PROMPT + (0,))) == (kv.blocks_of("a")[:1], 4)
    assert kv.get_computed_blocks(req("c", PROMPT + (0,), skip_reading_prefix_cache=True)) == ([], 0)


def test_only_full_computed_blocks_are_cached():
    """PFX-HIT-2: only full blocks are cached; with delayed caching nothing is until cache_blocks."""
    kv = KVCacheManager(16, 4)
    kv.allocate_slots(req("a", PROMPT[:10]), 10, [], 0, delay_caching=False)
    assert len(kv.pool.cached) == 2
    kv.allocate_slots(req("b", (0,) * 8), 0, [], 8, delay_caching=True)
    assert len(kv.pool.cached) == 2
    kv.cache_blocks(req("b", (0,) * 8), 8)
    assert len(kv.pool.cached) == 4


def test_async_block_completed_by_an_output_cached_when_processed(engine):
    """PFX-HIT-2: with async scheduling, a block whose last token was an output in flight when its computation was
    scheduled is cached once that output is processed, also when the output ends the request."""
    e = engine(async_scheduling=True)
    e.add_request(RequestSpec(request_id="r", prompt=(1, 0, 3, 2, 0, 3), max_tokens=3))
    drain(e)
    r = e.requests["r"]
    e.add_request(RequestSpec(request_id="again", prompt=r.prompt + tuple(r.output)))
    assert e.step().trace.answers[0][:2] == ("again", 8)


def test_duplicate_block_found_once_the_first_is_evicted():
    """PFX-HIT-2: of two blocks with the same hash lookups find the first cached, then the other once it is gone."""
    kv = KVCacheManager(16, 4)
    kv.allocate_slots(req("a"), 12, [], 0, delay_caching=False)
    kv.allocate_slots(req("b"), 12, [], 0, delay_caching=False)
    first, second = kv.blocks_of("a")[0], kv.blocks_of("b")[0]
    assert kv.pool.lookup(kv.pool.block_hash[first]) == first
    kv.pool._uncache(first)
    assert kv.pool.lookup(kv.pool.block_hash[second]) == second


def test_free_order_tail_first():
    """PFX-EVICT-1: a request's blocks are freed tail first and reallocated from the queue's front."""
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(req("a"), 12, [], 0, delay_caching=False)
    assert kv.free("a") == [1, 2, 3]
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 3, 2, 1]
    assert kv.pool.allocate(5)[-1] == 3 and len(kv.pool.cached) == 2


def test_uncached_blocks_freed_to_the_front():
    """PFX-EVICT-1: a freed block without a cached hash joins the free queue's front, to be reused first."""
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(req("b", PROMPT[:6]), 6, [], 0, delay_caching=False)
    assert kv.free("b") == [1, 2]
    assert list(kv.pool.free_queue) == [2, 3, 4, 5, 6, 7, 1]


def test_reset_refused_while_blocks_used():
    """PFX-RESET-1: reset_prefix_cache returns False while a block is used, True and forgets hashes when idle."""
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(req("a"), 12, [], 0, delay_caching=False)
    assert kv.pool.reset() is False and len(kv.pool.cached) == 3
    kv.free("a")
    assert kv.pool.reset() is True and kv.pool.cached == {}


# --- offload manager ---------------------------------------------------------------------------


def test_offload_key_is_last_gpu_block_hash(conn):
    """OFF-KEY-1: offloaded block i is keyed by the hash of its last GPU block; partial blocks have no key."""
    r = req(prompt=PROMPT * 2 + PROMPT[:10])
    assert conn(factor=3).offload_keys(r) == [r.block_hashes[2], r.block_hashes[5]]


def test_offload_keys_differ_by_tenant(conn):
    """OFF-KEY-2: requests that differ in LoRA name or cache salt never share an offload key."""
    keys = [set(conn().offload_keys(req(lora_name=lora, cache_salt=salt)))
            for lora, salt in ((None, None), ("x", None), (None, "a"), (None, "b"))]
    assert all(a.isdisjoint(b) for i, a in enumerate(keys) for b in keys[i + 1:])


def test_storing_block_not_readable():
    """OFF-MGR-2: lookup is None while a block is being stored, True once stored, False when absent."""
    manager = OffloadManager(4)
    manager.prepare_store([K[0]])
    assert (manager.lookup(K[0]), manager.lookup(K[1])) == (None, False)
    manager.complete_store([K[0]], success=True)
    assert manager.lookup(K[0]) is True


def test_prepare_load_pins_complete_load_unpins():
    """OFF-MGR-3: prepare_load pins (not evictable), complete_load unpins; loading a storing key is invalid."""
    manager = OffloadManager(1)
    stored(manager, K[0])
    manager.prepare_load([K[0]])
    assert manager.num_pinned() == 1 and manager.prepare_store([K[1]]) is None
    manager.complete_load([K[0]])
    assert manager.num_pinned() == 0 and manager.prepare_store([K[1]]).evicted == [K[0]]
    with pytest.raises(InvalidCall):
        manager.prepare_load([K[1]])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_touch_unknown_key_ignored(policy):
    """OFF-MGR-4: touching keys the store does not hold is allowed and changes nothing (vLLM #34576)."""
    manager = OffloadManager(2, policy)
    stored(manager, K[0])
    manager.touch([K[5], K[0], K[6]])
    assert [key for key, _ in manager.contents()] == [K[0]]


def test_prepare_store_deduplicates():
    """OFF-MGR-5: prepare_store reserves slots only for offered keys it does not hold yet."""
    manager = OffloadManager(4)
    stored(manager, K[0])
    manager.prepare_store([K[1]])
    out = manager.prepare_store([K[0], K[1], K[2]])
    assert out.keys_to_store == [K[2]] and len(out.slots) == 1 and out.evicted == []


def test_failed_store_drops_keys():
    """OFF-MGR-6: a failed store drops its keys and frees their slots; a successful one makes them readable."""
    manager = OffloadManager(2)
    manager.prepare_store([K[0], K[1]])
    manager.complete_store([K[0]], success=False)
    manager.complete_store([K[1]], success=True)
    assert (manager.lookup(K[0]), manager.lookup(K[1])) == (False, True)
    assert manager.prepare_store([K[2]]).evicted == []


def test_prepare_store_protects_offered_keys():
    """OFF-MGR-7: prepare_store never evicts the keys it was offered, even the least recently used."""
    manager = OffloadManager(2)
    stored(manager, K[0], K[1])
    out = manager.prepare_store([K[0], K[2]])
    assert out.keys_to_store == [K[2]] and out.evicted == [K[1]]
    assert manager.lookup(K[0]) is True


def test_prepare_store_none_without_room():
    """OFF-MGR-7: prepare_store returns None, changing nothing, when pinned or storing blocks leave no room."""
    manager = OffloadManager(2)
    stored(manager, K[0])
    manager.prepare_store([K[1]])
    manager.prepare_load([K[0]])
    assert manager.prepare_store([K[2]]) is None
    assert sorted(key for key, _ in manager.contents()) == [K[0], K[1]] and manager.lookup(K[2]) is False


def test_reset_connector_empties_store(primed):
    """OFF-MGR-8: reset_prefix_cache(reset_connector=True) empties the offload store."""
    assert len(primed.manager.contents()) == 3
    assert primed.reset_prefix_cache(reset_connector=True) is True
    first_key = primed.connector.offload_keys(primed.requests["r0"])[0]
    assert primed.manager.contents() == [] and primed.manager.lookup(first_key) is False


def test_store_events():
    """OFF-MGR-9: completed stores emit a stored event, evictions a removed event, each once."""
    manager = OffloadManager(1)
    stored(manager, K[0])
    stored(manager, K[1])
    assert [(e.keys, e.removed) for e in manager.take_events()] == [([K[0]], False), ([K[0]], True), ([K[1]], False)]
    assert manager.take_events() == []


def test_lru_evicts_least_recent():
    """OFF-LRU-1: LRU evicts the least recently stored or touched idle block."""
    manager = OffloadManager(3)
    stored(manager, K[0], K[1], K[2])
    manager.touch([K[0]])
    assert manager.prepare_store([K[3]]).evicted == [K[1]]


def test_lru_touch_order():
    """OFF-LRU-2: touch(keys) makes the keys most recent, the first key the most recent of all."""
    policy = LRUPolicy(4)
    for key in K[:4]:
        policy.mark_evictable(key)
    policy.touch([K[0], K[1]])
    assert list(policy.evictable) == [K[2], K[3], K[1], K[0]]


def test_arc_insert_enters_t1_leaves_ghosts():
    """OFF-ARC-2: a new block enters T1 and leaves the ghost lists."""
    manager = OffloadManager(1, "arc")
    stored(manager, K[0])
    stored(manager, K[1])
    assert list(manager.policy.b1) == [K[0]]
    stored(manager, K[0])
    assert list(manager.policy.t1) == [K[0]] and K[0] not in manager.policy.b1


def test_arc_promotion_t1_to_t2():
    """OFF-ARC-3: touching a ready T1 block moves it to T2; a block still being stored stays in T1."""
    manager = OffloadManager(4, "arc")
    stored(manager, K[0])
    manager.prepare_store([K[1]])
    manager.touch([K[0], K[1]])
    assert list(manager.policy.t2) == [K[0]] and list(manager.policy.t1) == [K[1]]


def test_arc_ghost_hits_adapt_target():
    """OFF-ARC-3: a B1 ghost hit raises the T1 target by max(1, |B2|/|B1|), a B2 hit lowers it, within [0, c]."""
    policy = ARCPolicy(4)
    policy.b1.update(dict.fromkeys(K[:2]))
    policy.b2.update(dict.fromkeys(K[2:6]))
    policy.touch([K[0]])
    assert policy.target_t1 == 2.0
    policy.touch([K[2]])
    assert policy.target_t1 == 1.0
    policy.touch([K[3]])
    policy.touch([K[3]])
    assert policy.target_t1 == 0


def test_arc_evicts_t1_first_into_ghost():
    """OFF-ARC-4: with |T1| at or above target the victim is T1's oldest idle block, which becomes a B1 ghost."""
    manager = OffloadManager(2, "arc")
    stored(manager, K[0], K[1])
    manager.touch([K[1]])
    assert manager.prepare_store([K[2]]).evicted == [K[0]]
    assert list(manager.policy.b1) == [K[0]] and list(manager.policy.t2) == [K[1]]


def test_arc_evict_is_atomic():
    """OFF-ARC-4: an eviction that cannot find enough idle victims evicts nothing."""
    manager = OffloadManager(2, "arc")
    stored(manager, K[0], K[1])
    policy = manager.policy
    assert policy.choose(2, protected={K[1]}) is None
    assert list(policy.t1) == [K[0], K[1]] and not policy.b1


def test_arc_t1_fallback_takes_a_t1_victim_where_t2_has_none():
    """OFF-ARC-4: T1 under its target and no T2 block: the spec's ARC refuses the store, its variant `arc_t1_fallback`
    takes T1's oldest evictable block (vLLM 0.30+), into B1, as the engine configures it."""
    for fallback in (False, True):
        manager = Engine(EngineConfig(eviction_policy="arc", num_offload_blocks=2, arc_t1_fallback=fallback)).manager
        stored(manager, K[0], K[1])
        manager.touch([K[0]])  # K0 to T2, pinned by a load: T2 has no evictable block
        manager.prepare_load([K[0]])
        manager.policy.target_t1 = 2.0  # T1's one block is under its target
        taken = manager.prepare_store([K[2]])
        if not fallback:
            assert taken is None and list(manager.policy.t1) == [K[1]]
        else:
            assert taken.evicted == [K[1]] and taken.keys_to_store == [K[2]] and list(manager.policy.b1) == [K[1]]


def test_followed_victims_are_taken_where_the_arc_policy_finds_too_few():
    """CONF-RUN-2: victims of a known OFF-ARC-1 deviation are taken also where the spec's ARC finds none (T1 under
    its target, T2's only block pinned by a load, as vLLM 0.32's ARC falls back to T1): the store goes on, and the
    output says the policy found none, so the deviation is recorded; victims that are not idle are not taken."""
    manager = OffloadManager(2, "arc")
    stored(manager, K[0], K[1])
    stored(manager, K[2])
    manager.touch([K[0]])
    manager.touch([K[0]])  # two B1 ghost hits: T1's target is 2
    manager.touch([K[1]])  # K1 to T2
    manager.prepare_load([K[1]])
    assert manager.prepare_store([K[3]]) is None
    assert manager.prepare_store([K[3]], victims=[K[1]]) is None
    taken = manager.prepare_store([K[3]], victims=[K[2]])
    assert taken.evicted == [K[2]] and taken.keys_to_store == [K[3]] and taken.policy_victims is None


# --- connector -----------------------------------------------------------------------------------


def test_match_deferred_while_request_has_transfers(conn):
    """CONN-MATCH-4: a request with in-flight transfer jobs is answered (None, False) and not looked up."""
    c = conn()
    r = req()
    c.on_new_request(r)
    c.states["r"].transfer_jobs.add(7)
    assert c.get_num_new_matched_tokens(r, 0) == (None, False) and c.recorder.lookups == {}


@pytest.mark.parametrize("forgets", [False, True])
def test_reset_forgets_stores_answers_at_once(engine, forgets):
    """CONN-MATCH-4's variant: after a connector reset, a preempted request whose store was in flight and that an
    engine admits at once is deferred until the store's completion is reported; with `reset_forgets_stores` it
    is answered at once (vLLM 0.28+)."""
    e = engine(reset_forgets_stores=forgets)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT, max_tokens=4))
    e.step()
    e.preempt("r")
    assert e.reset_prefix_cache(reset_connector=True)
    result = e.step(followed=FollowedSchedule({"r": len(PROMPT)}, ("r",), frozenset({"r"}), frozenset()))
    assert result.trace.answers == [("r", 0, 0 if forgets else None, False)]
    assert result.scheduled_tokens == ({"r": len(PROMPT)} if forgets else {})



@pytest.mark.parametrize("forgets", [False, True])
def test_reset_keeps_an_aborted_load_holding_its_blocks(engine, forgets):
    """CONN-MATCH-4's variant forgets discarded stores only: a request aborted during a load the reset discarded keeps
    its blocks until the load ends (LIFE-ABORT-1), so a prefix-cache reset fails until then, as on vLLM 0.30/0.32."""
    e = admit_with_load(engine(reset_forgets_stores=forgets))
    assert not e.reset_prefix_cache(reset_connector=True)
    e.abort("r1")
    assert e.delayed_free == {"r1"} and not e.reset_prefix_cache()
    drain(e)
    assert e.reset_prefix_cache()

def test_lookup_defers_while_block_storing(conn):
    """OFF-LOOKUP-3: a looked-up block still being stored defers the answer (None)."""
    c = conn()
    r = req()
    c.on_new_request(r)
    keys = c.offload_keys(r)
    stored(c.manager, keys[0])
    c.manager.prepare_store([keys[1]])
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)


def test_lookup_defers_while_hit_block_loading(conn):
    """OFF-LOOKUP-4: a hit whose blocks are being loaded for another request is deferred (None)."""
    c = conn()
    a, b = req("a"), req("b")
    c.on_new_request(a)
    c.on_new_request(b)
    stored(c.manager, *c.offload_keys(a))
    assert c.get_num_new_matched_tokens(a, 0) == (12, True)
    c.update_state_after_alloc(a, [1, 2, 3], 12)
    assert c.get_num_new_matched_tokens(b, 0) == (None, False)


def test_alloc_creates_one_load_job(conn):
    """CONN-ALLOC-1: update_state_after_alloc makes one load job past the local hit and pins its keys."""
    c = conn(factor=3)
    r = req(prompt=PROMPT * 2 + (0,))
    c.on_new_request(r)
    stored(c.manager, *c.offload_keys(r))
    assert c.get_num_new_matched_tokens(r, 4) == (20, True)
    c.update_state_after_alloc(r, list(range(10, 17)), 20)
    assert c.recorder.loads == [("r", [0, 1], 1, 5)] and c.manager.num_pinned() == 2


def test_loaded_hit_is_not_offered_again(conn):
    """OFF-STORE-1: the blocks a request's hit covered when it was admitted with a load are not offered again."""
    c = conn()
    r = req()
    c.on_new_request(r)
    stored(c.manager, *c.offload_keys(r))
    assert c.get_num_new_matched_tokens(r, 4) == (8, True)
    c.update_state_after_alloc(r, [1, 2, 3], 8)
    r.num_computed_tokens = 11
    c.build_connector_meta(sched_output(r, 1, [1, 2, 3]))
    assert c.recorder.store_offers == []


@pytest.mark.parametrize("restart_offers_on_lookup", [False, True])
def test_offers_restart_on_lookup_if_declared(engine, restart_offers_on_lookup):
    """OFF-STORE-7: a preempted request asked about again offers its blocks from the first one again only if the
    config says so; otherwise the blocks it offered before its preemption count as offered."""
    e = engine(restart_offers_on_lookup=restart_offers_on_lookup)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT, max_tokens=3))
    assert e.step().trace.store_offers == [("r", [0, 1, 2])]
    e.preempt("r")
    assert e.step().scheduled_tokens == {}, "no admission in the step after a preemption (SCHED-ORDER-1)"
    resumed = e.step().trace
    assert resumed.answers == [("r", 12, 0, False)]
    assert resumed.store_offers == ([("r", [0, 1, 2])] if restart_offers_on_lookup else [])


def test_finished_request_offered_at_the_next_step(engine):
    """OFF-STORE-6: with offer_at_finish, the step after a request finishes offers its computed blocks not stored
    yet; under async scheduling that is the block its last step computed."""
    for offer_at_finish, expected in ((False, []), (True, [("r", [2])])):
        e = engine(async_scheduling=True, offer_at_finish=offer_at_finish)
        e.add_request(RequestSpec(request_id="r", prompt=PROMPT[:10], max_tokens=3))
        offers = [e.step().trace.store_offers for _ in range(6)]
        assert offers[:4] == [[("r", [0, 1])], [], [], []] and e.requests["r"].is_finished
        assert offers[4] == expected and offers[5] == []


def test_store_of_a_finished_request_flushed_before_its_blocks_are_reused(engine):
    """OFF-STORE-6, XFER-SAFE-1: a store of a finished request's blocks runs before a step that reallocates them."""
    e = engine(num_gpu_blocks=5, async_scheduling=True, offer_at_finish=True)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT[:10], max_tokens=3))
    for _ in range(4):
        e.step()
    e.add_request(RequestSpec(request_id="s", prompt=(3,) * 12))
    meta_flushes = []
    build = e.connector.build_connector_meta
    e.connector.build_connector_meta = (
        lambda output, deviations: meta_flushes.append(build(output, deviations)) or meta_flushes[-1])
    result = e.step()
    (meta,) = meta_flushes
    (store,) = [job for job in meta.store_jobs if job.request_id == "r"]
    assert store.job_id in meta.jobs_to_flush and not set(store.gpu_blocks).isdisjoint(result.forward_writes)
    assert not set(store.gpu_blocks) & result.store_reads_in_flight, "flushed before the forward"


def test_store_flushed_when_its_blocks_become_a_hit_if_declared(engine):
    """LIFE-FREE-2: with flush_on_hit, a pending store is flushed when its blocks become another request's hit."""
    for flush_on_hit in (False, True):
        e = engine(flush_on_hit=flush_on_hit)
        e.add_request(RequestSpec(request_id="r0", prompt=PROMPT))
        e.step()
        e.add_request(RequestSpec(request_id="r1", prompt=PROMPT[:8] + (1, 1, 1, 1)))
        metas = []
        build = e.connector.build_connector_meta
        e.connector.build_connector_meta = (  # this round's list and builder, bound now
            lambda output, deviations, metas=metas, build=build: metas.append(build(output, deviations)) or metas[-1])
        e.step()
        assert metas[0].jobs_to_flush == ({0} if flush_on_hit else set())


@pytest.mark.parametrize("flush_all", [False, True])
def test_every_job_flushed_at_a_preemption_if_declared(engine, flush_all):
    """LIFE-FREE-2: with flush_all_on_preemption, a step that preempts finishes every job in flight, another
    request's load included: the load is reported in that step and its request runs in the next (vLLM's
    SimpleCPUOffloadConnector); without it, the load waits for its transfer to complete."""
    e = engine(num_offload_blocks=12, flush_all_on_preemption=flush_all)
    prompt = (1, 0, 3, 2) * 3
    offloaded_then_forgotten(e, prompt)
    e.add_request(RequestSpec(request_id="loader", prompt=prompt + (2,)))
    e.add_request(RequestSpec(request_id="long", prompt=(2,) * 44 + (3, 0, 2, 0), max_tokens=3))
    assert e.step().scheduled_tokens == {"long": 48}
    preempting = e.step()
    assert preempting.preempted == {"long"}
    assert preempting.reports.loads_finished == (["loader"] if flush_all else [])
    assert e.step().scheduled_tokens == ({"loader": 1} if flush_all else {})


@pytest.mark.parametrize("flush_on_hit", [False, True])
def test_store_flushed_when_a_loaded_request_first_runs_if_declared(engine, flush_on_hit):
    """LIFE-FREE-2: with flush_on_hit, the step in which a request that waited for its load first runs counts all its
    blocks as newly scheduled, so the store of a finished request that reads one of them is flushed (vLLM 0.34)."""
    e = engine(num_gpu_blocks=64, block_size_factor=3, num_offload_blocks=12, async_scheduling=True,
               offer_at_finish=True, flush_on_hit=flush_on_hit)
    prompt = (1, 0, 3, 2) * 6
    offloaded_then_forgotten(e, prompt)
    e.add_request(RequestSpec(request_id="short", prompt=prompt[:11], max_tokens=2))
    e.add_request(RequestSpec(request_id="loader", prompt=prompt))
    steps = []
    build = e.connector.build_connector_meta
    e.connector.build_connector_meta = (
        lambda output, deviations: steps.append((output, build(output, deviations))) or steps[-1][1])
    for _ in range(4):
        e.complete_transfers(False, False)
        e.step()
    output, meta = steps[-1]
    assert output.num_scheduled_tokens == {"loader": 1} and [job.request_id for job in meta.store_jobs] == ["short"]
    assert meta.jobs_to_flush == ({meta.store_jobs[0].job_id} if flush_on_hit else set())


def test_load_job_is_exactly_the_reported_tokens(conn):
    """CONN-LOAD-1: no load job is created for a 0-token answer; a job covers exactly the reported tokens."""
    c = conn()
    r = req()
    c.on_new_request(r)
    c.update_state_after_alloc(r, [1, 2, 3], 0)
    assert c.pending_loads == []
    stored(c.manager, *c.offload_keys(r))
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, [1, 2, 3], 8)
    assert [job.gpu_blocks for job in c.pending_loads] == [[1, 2]]


def pending_full_load(conn):
    """Return a connector with a load of a fully stored 12-token request pending, and that request."""
    c = conn()
    r = req()
    c.on_new_request(r)
    stored(c.manager, *c.offload_keys(r))
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, [1, 2, 3], 12)
    return c, r


def test_meta_carries_this_steps_loads_once(conn):
    """CONN-STEP-1: build_connector_meta hands out the step's load jobs once."""
    c, r = pending_full_load(conn)
    empty = SchedulerOutput({}, {}, {}, set(), set())
    assert [job.keys for job in c.build_connector_meta(empty).load_jobs] == [c.offload_keys(r)]
    assert c.build_connector_meta(empty).load_jobs == []


def test_meta_carries_loads_stores_and_flushes(conn):
    """CONN-STEP-3: a step's metadata carries its load jobs, its store jobs and the jobs to flush."""
    c = conn()
    r, s = req("r"), req("s", (1,) * 8)
    for each in (r, s):
        c.on_new_request(each)
    stored(c.manager, *c.offload_keys(r))
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, [1, 2, 3], 12)
    meta = c.build_connector_meta(sched_output(s, 8, [4, 5], preempted=["s"]))
    assert [j.request_id for j in meta.load_jobs] == ["r"] and [j.request_id for j in meta.store_jobs] == ["s"]
    flushed = c.build_connector_meta(sched_output(s, 0, [4, 5], preempted=["s"])).jobs_to_flush
    assert flushed == {meta.store_jobs[0].job_id}


def test_worker_flushes_before_loads():
    """CONN-STEP-2: start_load_kv completes the flushed in-flight stores, then submits the loads."""
    worker = OffloadConnectorWorker(TransferEngine(4, 2, 4, 1, 2, "float32", CPU))
    store = TransferJob(0, "r", True, [K[0]], [0], [1], [0])
    load = TransferJob(1, "s", False, [K[1]], [0], [2], [1])
    worker.in_flight[0] = store
    worker.start_load_kv(ConnectorMetadata([load], [], {0}))
    assert list(worker.in_flight) == [1] and worker.get_finished().finished_jobs == {0: True}


def test_deferred_stores_are_submitted_at_the_next_step():
    """CONN-STEP-2's variant `defer_stores`: a step's store is queued after the forward and submitted at the next
    step's start, before its flushes; let finish while queued, it runs then, with its first completion's outcome."""
    worker = OffloadConnectorWorker(TransferEngine(4, 2, 4, 1, 2, "float32", CPU), defer_stores=True)
    stores = [TransferJob(0, "r", True, [K[0]], [0], [1], [0]), TransferJob(1, "s", True, [K[1]], [0], [2], [1])]
    worker.wait_for_save(ConnectorMetadata([], stores, set()))
    assert worker.in_flight == {} and worker.store_sources_in_flight() == {1, 2}
    worker.complete_transfers(fail_loads=False, fail_stores=False)
    worker.complete_transfers(fail_loads=False, fail_stores=True)  # the first completion's outcome holds
    assert worker.get_finished().finished_jobs == {}
    worker.start_load_kv(ConnectorMetadata([], [], set()))
    assert worker.in_flight == {} and worker.get_finished().finished_jobs == {0: True, 1: True}
    worker.wait_for_save(ConnectorMetadata([], stores, set()))
    worker.start_load_kv(ConnectorMetadata([], [], {1}))  # submitted, then the flushed one waited for
    assert list(worker.in_flight) == [0] and worker.get_finished().finished_jobs == {1: True}


def test_connector_output_finishes_each_job_once(conn):
    """CONN-STEP-4: a reported store job completes its keys once; reporting it again is an error."""
    c = conn()
    r = req()
    c.on_new_request(r)
    job_id = c.build_connector_meta(sched_output(r, 12, [1, 2, 3])).store_jobs[0].job_id
    c.update_connector_output(ConnectorOutput({job_id: True}))
    assert c.manager.lookup(c.offload_keys(r)[2]) is True and c.jobs == {}
    with pytest.raises(KeyError):
        c.update_connector_output(ConnectorOutput({job_id: True}))


def test_connector_reset_discards_the_jobs_in_flight():
    """CONN-STEP-4: a connector reset discards the jobs in flight, whose completions are never reported; the kit does
    not wait for them once drained (OFF-MGR-8)."""
    execution = Execution(Session(ReferenceAdapter))
    execution.begin()
    for call in (Call("start", (EngineConfig(block_size_factor=1),)),
                 Call("add_request", (RequestSpec(request_id="r", prompt=PROMPT),)), Call("step")):
        execution.apply(call)
    offloading = execution.judges[0].ctx
    assert set(offloading.jobs_in_flight) == {(True, "r", (0, 1, 2))}
    execution.apply(Call("reset_prefix_cache", (True,)))
    execution.apply(Call("drain"))
    assert not offloading.jobs_in_flight


def test_store_offered_again_after_no_room(conn):
    """OFF-STORE-4: blocks prepare_store had no room for are offered again at the request's next step."""
    c = conn(slots=1)
    r = req()
    c.on_new_request(r)
    assert c.build_connector_meta(sched_output(r, 12, [1, 2, 3])).store_jobs == []
    c.manager.prepare_store([K[0]])
    c.manager.complete_store([K[0]], success=True)
    assert c.recorder.store_offers == [("r", [0, 1, 2])] and c.states["r"].next_stored_index == 0


def test_store_job_reads_whole_offloaded_blocks(conn):
    """OFF-STORE-5: a store job reads every GPU block of each written offloaded block, into its slot's rows."""
    c = conn(factor=3)
    r = req(prompt=PROMPT * 2)
    c.on_new_request(r)
    [job] = c.build_connector_meta(sched_output(r, 24, list(range(1, 7)))).store_jobs
    assert job.gpu_blocks == [1, 2, 3, 4, 5, 6] and sorted(job.rows) == list(range(6))
    assert job.rows[:3] == [job.rows[0] + i for i in range(3)]


def test_finished_with_store_only_is_not_delayed(conn):
    """CONN-FIN-1: request_finished returns False with only stores in flight, True with a load in flight."""
    c = conn()
    r, s = req("r"), req("s")
    c.on_new_request(r)
    c.on_new_request(s)
    c.build_connector_meta(sched_output(r, 12, [1, 2, 3]))
    assert c.request_finished(r) is False and set(c.store_jobs_by_gpu_block) == {1, 2, 3}
    stored(c.manager, *c.offload_keys(s))
    c.get_num_new_matched_tokens(s, 0)
    c.update_state_after_alloc(s, [4, 5, 6], 12)
    assert c.request_finished(s) is True


# --- transfer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_transfer_round_trip_bytes_equal(dtype):
    """XFER-COPY-1: GPU blocks copied to store rows and back come back byte for byte."""
    transfer = TransferEngine(6, 2, 4, 2, 8, dtype, CPU)
    transfer.gpu[1:3] = torch.rand(2, 4, 8).to(transfer.gpu.dtype)
    original = transfer.gpu[1:3].clone()
    transfer.copy_to_store([1, 2], transfer.store_rows(1, 0, 2))
    transfer.copy_to_gpu(transfer.store_rows(1, 0, 2), [4, 5])
    assert torch.equal(transfer.gpu[4:6], original) and torch.equal(transfer.store[2:4], original)
    with pytest.raises(InvalidCall):
        TransferEngine(2, 1, 4, 1, 8, "int8", CPU)


def test_transfer_pairs_scattered_blocks():
    """XFER-COPY-1: blocks in mixed runs and out of order each land in their paired row, and back."""
    transfer = TransferEngine(9, 8, 4, 1, 8, "float16", CPU)
    transfer.gpu[1:] = torch.rand(8, 4, 8).to(transfer.gpu.dtype)
    gpu_blocks, rows = [3, 4, 5, 1, 8, 7, 2, 6], [0, 1, 2, 6, 3, 4, 7, 5]
    transfer.copy_to_store(gpu_blocks, rows)
    assert all(torch.equal(transfer.store[row], transfer.gpu[block])
               for block, row in zip(gpu_blocks, rows, strict=True))
    original = transfer.gpu.clone()
    transfer.gpu.zero_()
    transfer.copy_to_gpu(rows, gpu_blocks)
    assert torch.equal(transfer.gpu[1:], original[1:])


def test_kv_content_deterministic():
    """XFER-DATA-1: KV bytes depend only on the extra keys and the token prefix."""
    states = kv_content.token_states(kv_content.initial_state(None, None), PROMPT)
    again = kv_content.token_states(kv_content.initial_state(None, None), PROMPT[:5] + (0,), states[:5])
    assert again[:5] == states[:5] and again[5] != states[5]
    assert kv_content.initial_state(None, "a") != kv_content.initial_state(None, None)
    assert torch.equal(kv_content.kv_values(states, 8, torch.float16),
                       kv_content.kv_values(list(states), 8, torch.float16))


def test_next_token_deterministic():
    """XFER-DATA-2: the sampled token is the chain state of the last token modulo the vocabulary."""
    assert [kv_content.next_token(s) for s in (0, 5, 6, 7)] == [0, 1, 2, 3]


def test_load_rows_start_mid_offloaded_block(conn):
    """XFER-LOAD-1: a load starting inside an offloaded block reads that block's rows from the hit position on."""
    c = conn(factor=3)
    r = req(prompt=PROMPT * 2 + (0,))
    c.on_new_request(r)
    stored(c.manager, *c.offload_keys(r))
    slots = [c.manager.policy.get(key).slot for key in c.offload_keys(r)]
    c.get_num_new_matched_tokens(r, 4)
    c.update_state_after_alloc(r, list(range(10, 17)), 20)
    assert c.pending_loads[0].rows == [slots[0] * 3 + 1, slots[0] * 3 + 2, *(slots[1] * 3 + i for i in range(3))]


def test_stores_submitted_after_forward():
    """XFER-STORE-1: store jobs are submitted in wait_for_save, after the forward, not in start_load_kv."""
    worker = OffloadConnectorWorker(TransferEngine(4, 2, 4, 1, 2, "float32", CPU))
    meta = ConnectorMetadata([], [TransferJob(0, "r", True, [K[0]], [0], [1], [0])], set())
    worker.start_load_kv(meta)
    assert worker.in_flight == {}
    worker.wait_for_save(meta)
    assert worker.store_sources_in_flight() == {1}


# --- scheduling ---------------------------------------------------------------------------------


def test_sync_step_processes_its_own_output(engine):
    """SCHED-STEP-1: in sync mode a step's sampled tokens are processed in that same step."""
    e = engine()
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT))
    result = e.step()
    assert result.scheduled_tokens == {"r": 12} and result.finished == ["r"] and e.requests["r"].output != []


def test_running_before_waiting_within_budget(engine):
    """SCHED-ORDER-1: running requests are scheduled first; waiting ones get what is left of the budget."""
    e = engine(max_num_batched_tokens=8)
    e.add_request(RequestSpec(request_id="a", prompt=PROMPT * 2))
    e.add_request(RequestSpec(request_id="b", prompt=(1, 1, 1, 1)))
    assert [e.step().scheduled_tokens for _ in range(3)] == [{"a": 8}, {"a": 8}, {"a": 8}]
    assert e.step().scheduled_tokens == {"b": 4}


def test_loaded_request_considered_before_preempted(engine):
    """SCHED-ORDER-1: a request whose load finished is considered before a preempted one, so neither starves."""
    e = engine(num_gpu_blocks=12, block_size_factor=1, num_offload_blocks=3, eviction_policy="arc",
               max_num_batched_tokens=16)
    prompt = (0, 2) * 12 + (0,) * 9
    for request_id, extra in [("r0", {}), ("r1", {"cache_salt": "a"}), ("r2", {"lora_name": "x"}),
                              ("r3", {"cache_salt": "a"}), ("r4", {})]:
        e.add_request(RequestSpec(request_id=request_id, prompt=prompt[:12] if request_id == "r1" else prompt, **extra))
    for _ in range(40):
        e.complete_transfers(False, False)
        e.step()
    assert all(r.is_finished for r in e.requests.values()), {k: r.status for k, r in e.requests.items()}


def test_block_holders_first_in_every_step(engine):
    """SCHED-ORDER-1: a loaded request that could not fit stays ahead of a preempted one in later steps too."""
    e = engine(num_gpu_blocks=12, block_size_factor=2, num_offload_blocks=2, eviction_policy="arc",
               max_num_batched_tokens=16)
    prompt = (0, 2) * 6 + (0,) * 8
    e.add_request(RequestSpec(request_id="r0", prompt=prompt))
    for _ in range(2):
        e.complete_transfers(False, False)
        e.step()
    assert e.reset_prefix_cache()
    e.add_request(RequestSpec(request_id="r1", prompt=prompt))
    e.add_request(RequestSpec(request_id="r2", prompt=prompt))
    e.add_request(RequestSpec(request_id="r3", prompt=prompt + (0,) * 6, max_tokens=4, skip_reading_prefix_cache=True))
    for _ in range(30):
        e.complete_transfers(False, False)
        e.step()
    assert all(r.is_finished for r in e.requests.values()), {k: r.status for k, r in e.requests.items()}


def deferred_between_loads(e: Engine, before: tuple[str, ...] = ()) -> None:
    """Queue `before`, then "first" and "last", admitted with loads, and between them "deferred", whose lookup is
    deferred while "first" loads its block, and run the step that admits them."""
    prompt, long_prompt = (2,) * 8 + (3, 1, 0, 0), (0, 2) * 23 + (0, 1)
    e.add_request(RequestSpec(request_id="writer", prompt=prompt + (1, 0, 1), max_tokens=2))
    e.add_request(RequestSpec(request_id="short", prompt=(0, 2) * 4, max_tokens=3))
    e.add_request(RequestSpec(request_id="long_writer", prompt=long_prompt, lora_name="lora-x"))
    drain(e)
    assert e.reset_prefix_cache()
    for request_id in before:
        e.add_request(RequestSpec(request_id=request_id, prompt=(3,) * 5, max_tokens=8))
    for request_id in ("first", "deferred"):
        e.add_request(RequestSpec(request_id=request_id, prompt=prompt))
    e.add_request(RequestSpec(request_id="last", prompt=long_prompt[:24] + (3, 3, 3), lora_name="lora-x"))
    answers = e.step().trace.answers
    assert [(request_id, external) for request_id, _, external, _ in answers][-3:] == [
        ("first", 12), ("deferred", None), ("last", 12)]


def test_block_holders_before_deferred_requests(engine):
    """SCHED-ORDER-1: a request whose lookup is deferred while another loads its block keeps its place in the queue,
    behind the requests that hold blocks for their loads; once the loads are done those run first (vLLM 0.34)."""
    e = engine(num_gpu_blocks=64, block_size_factor=3, num_offload_blocks=2, max_num_batched_tokens=16)
    deferred_between_loads(e)
    e.step()
    e.complete_transfers(False, False)
    e.step()
    assert list(e.step().scheduled_tokens) == ["first", "last"]
    assert e.step().scheduled_tokens == {"deferred": 4}


def test_deferred_request_keeps_its_place(engine):
    """SCHED-ORDER-1: a request whose lookup was deferred keeps its place in the queue: a request preempted later, at
    the queue's front, is asked first (vLLM 0.34; the judge follows 0.24's other order, test_followed_schedule.py)."""
    e = engine(num_gpu_blocks=64, block_size_factor=3, num_offload_blocks=2, max_num_batched_tokens=16)
    deferred_between_loads(e, before=("runner",))
    e.preempt("runner")
    assert e.step().trace.answers == [], "no admission in the step after a preemption"
    assert [request_id for request_id, *_ in e.step().trace.answers] == ["runner", "deferred"]


def test_two_loads_never_deadlock(engine):
    """SCHED-ADMIT-1: an admission with a load leaves free the blocks an earlier load's request still needs, so two
    loads never wait for each other's blocks (found by the state machine as LIFE-LIVE-1; vLLM #45388)."""
    e = engine(num_gpu_blocks=16, block_size_factor=1, num_offload_blocks=12, max_num_batched_tokens=256)
    e.add_request(RequestSpec(request_id="short", prompt=(0, 2) * 6, cache_salt="b"))
    e.add_request(RequestSpec(request_id="head", prompt=(0, 2) * 2, cache_salt="a"))
    for _ in range(4):
        e.complete_transfers(False, False)
        e.step()
    assert e.reset_prefix_cache()
    e.add_request(RequestSpec(request_id="long", prompt=(0, 2) * 20 + (0, 1, 2, 3, 3, 1, 0, 0, 0), cache_salt="a"))
    e.add_request(RequestSpec(request_id="again", prompt=(0, 2) * 6, cache_salt="b"))
    assert e.step().trace.loads == [("long", [0], 0, 1)]
    assert e.kv.blocks_of("again") == [], "the other load would take blocks the long prompt still needs: it waits"
    for _ in range(20):
        e.complete_transfers(False, False)
        e.step()
    assert all(r.is_finished for r in e.requests.values()), {k: r.status for k, r in e.requests.items()}


def test_allocate_slots_none_when_short():
    """SCHED-ALLOC-1: allocate_slots returns None and allocates nothing when the pool is short."""
    kv = KVCacheManager(3, 4)
    assert kv.allocate_slots(req(), 12, [], 0, delay_caching=False) is None
    assert kv.pool.num_free_blocks == 2 and kv.blocks_of("r") == []


def test_admission_needs_the_full_sequence(engine):
    """SCHED-ADMIT-1: a waiting request is admitted only if its whole sequence fits, not just its first chunk."""
    prompt = PROMPT * 2
    short = engine(num_gpu_blocks=6, max_num_batched_tokens=8)
    short.add_request(RequestSpec(request_id="a", prompt=prompt))
    assert short.step().scheduled_tokens == {}
    enough = engine(num_gpu_blocks=7, max_num_batched_tokens=8)
    enough.add_request(RequestSpec(request_id="a", prompt=prompt))
    assert enough.step().scheduled_tokens == {"a": 8}


def test_async_load_leaves_room_for_inflight_prefills(engine):
    """SCHED-ADMIT-1: a load is admitted only if the blocks in-flight prefills still need stay free."""
    other = tuple((i * 5 + 1) % 4 for i in range(12))
    e = engine(num_gpu_blocks=8)
    e.add_request(RequestSpec(request_id="p", prompt=PROMPT))
    e.add_request(RequestSpec(request_id="q", prompt=other))
    e.step()
    e.complete_transfers(False, False)
    e.step()
    assert e.reset_prefix_cache()
    e.add_request(RequestSpec(request_id="l", prompt=PROMPT + (1,) * 8))
    e.add_request(RequestSpec(request_id="m", prompt=other))
    loads = e.step().trace.loads
    assert loads == [("l", [0, 1, 2], 0, 3)], "m's 3 blocks would leave fewer than the 2 that l still needs"


def test_preempt_newest_when_pool_short(engine):
    """SCHED-PREEMPT-1: a running request short of blocks preempts the newest running request."""
    e = engine(num_gpu_blocks=5)
    e.add_request(RequestSpec(request_id="a", prompt=PROMPT[:8], max_tokens=3))
    e.add_request(RequestSpec(request_id="b", prompt=PROMPT[:8], max_tokens=3))
    e.step()
    result = e.step()
    assert result.scheduled_tokens == {"a": 1} and e.requests["b"].num_computed_tokens == 0
    assert [r.request_id for r in e.waiting] == ["b"]


def test_preemption_of_a_request_the_step_in_flight_holds(engine):
    """SCHED-PREEMPT-1: the newest running request is preempted for room even while the step in flight holds its
    blocks; they return once that step's output is processed (LIFE-FREE-3)."""
    e = engine(num_gpu_blocks=5, async_scheduling=True)
    e.add_request(RequestSpec(request_id="a", prompt=PROMPT[:8], max_tokens=3))
    e.add_request(RequestSpec(request_id="b", prompt=PROMPT[:8], max_tokens=3))
    e.step()
    assert e.step().preempted == {"b"} and e.requests["b"].num_computed_tokens == 0


def test_async_output_lags_one_step(engine):
    """SCHED-ASYNC-1: with async scheduling a step's output is processed in the next step."""
    e = engine(async_scheduling=True)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT))
    assert e.step().finished == [] and e.requests["r"].num_output_placeholders == 1
    assert e.step().finished == ["r"]


def test_async_empty_batch_processed_next_step(engine):
    """SCHED-ASYNC-1, SCHED-STEP-1: a batch that scheduled nothing is processed a step later, like any other;
    an engine without work only processes the batch in flight."""
    e = engine(async_scheduling=True)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT))
    e.step()
    e.step()
    e.complete_transfers(False, False)
    key = e.connector.offload_keys(e.requests["r"])[0]
    assert e.step().scheduled_tokens == {} and e.manager.lookup(key) is None, "finished, reported, not processed"
    e.step()
    assert e.manager.lookup(key) is True and e.in_flight is not None and not e.has_work()
    e.step()
    assert e.in_flight is None


# --- lifecycle ----------------------------------------------------------------------------------


def test_request_id_reuse_is_invalid(engine):
    """LIFE-ADD-1: adding a request id that was already used is an invalid call."""
    e = engine()
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT))
    with pytest.raises(InvalidCall):
        e.add_request(RequestSpec(request_id="r", prompt=PROMPT))


def test_abort_during_load_delays_free(loading):
    """LIFE-ABORT-1: aborting a request whose load is in flight keeps its GPU blocks until the load ends."""
    loading.abort("r1")
    assert loading.delayed_free == {"r1"} and len(loading.kv.blocks_of("r1")) == 3
    loading.complete_transfers(False, False)
    assert loading.step().freed == ["r1"] and loading.kv.blocks_of("r1") == []
    with pytest.raises(InvalidCall):
        loading.abort("r1")


def test_preemption_resets_computed_tokens(engine):
    """LIFE-PREEMPT-1: preemption frees the request's blocks and resets its computed tokens to 0."""
    e = engine()
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT, max_tokens=3))
    e.step()
    e.preempt("r")
    assert e.requests["r"].num_computed_tokens == 0 and e.kv.blocks_of("r") == [] and e.waiting[0].request_id == "r"
    assert e.kv.pool.num_free_blocks == 15


def test_preempted_request_keeps_its_inflight_token(engine):
    """LIFE-PREEMPT-1: a token sampled for a request in a step still in flight is appended after its preemption."""
    e = engine(async_scheduling=True)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT, max_tokens=3))
    e.step()
    e.preempt("r")
    e.step()
    request = e.requests["r"]
    assert len(request.output) == 1 and request.status is RequestStatus.WAITING and request.num_computed_tokens == 0


def test_blocks_freed_once_the_step_in_flight_is_processed(engine):
    """LIFE-FREE-3: with async scheduling an aborted request's blocks return only once its step is processed."""
    e = engine(async_scheduling=True)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT, max_tokens=3))
    e.step()
    e.abort("r")
    assert e.kv.pool.num_free_blocks == 12 and e.reset_prefix_cache() is False
    e.step()
    assert e.kv.pool.num_free_blocks == 15


def test_load_waits_then_counts_as_computed(loading):
    """LIFE-LOAD-1: a loading request is not scheduled until its load is reported done."""
    assert loading.step().scheduled_tokens == {}
    loading.complete_transfers(False, False)
    assert loading.step().scheduled_tokens == {}
    assert loading.step().scheduled_tokens == {"r1": 1}


def test_full_prompt_load_recomputes_last_token(loading):
    """LIFE-LOAD-2: when a load covers the whole prompt the last token is recomputed."""
    loading.complete_transfers(False, False)
    loading.step()
    result = loading.step()
    assert result.scheduled_tokens == {"r1": 1} and result.computed_tokens == {"r1": 12}


def test_failed_load_falls_back_to_local_hit(loading):
    """LIFE-LOAD-3: a failed load leaves only the local hit computed; the rest is recomputed."""
    loading.complete_transfers(True, False)
    loading.step()
    assert loading.step().scheduled_tokens == {"r1": 8}


@pytest.mark.parametrize("local_hit_after_failed_load", [True, False])
def test_failed_load_falls_back_to_nothing_if_declared(engine, local_hit_after_failed_load):
    """LIFE-LOAD-3: a request whose load failed keeps its local hit, unless the config says it falls back to nothing:
    then its blocks are freed when the failure is processed and it is admitted afresh, finding the hit again (vLLM
    0.34's OffloadingConnector; `--profile dev` seed 4 on 0.34 found the reference keeping the hit)."""
    e = admit_with_load(engine(lookup_after_failed_load=False, local_hit_after_failed_load=local_hit_after_failed_load))
    e.complete_transfers(True, False)
    assert e.step().computed_tokens["r1"] == (4 if local_hit_after_failed_load else 0)
    resumed = e.step()
    assert resumed.scheduled_tokens == {"r1": 8}
    assert resumed.trace.answers == ([] if local_hit_after_failed_load else [("r1", 4, 0, False)])


def test_failed_load_without_hit_is_admitted_afresh(engine):
    """LIFE-LOAD-3: a request whose load of its whole prompt failed is admitted afresh: no reservation of its own
    is left to keep its next load out of a pool that holds it only once (found by the state machine)."""
    e = engine(num_gpu_blocks=16)
    prompt = (0, 2) * 16
    offloaded_then_forgotten(e, prompt)
    e.add_request(RequestSpec(request_id="reader", prompt=prompt))
    assert e.step().trace.loads
    e.complete_transfers(True, False)
    for _ in range(8):
        e.step()
        e.complete_transfers(False, False)
    assert e.requests["reader"].is_finished


@pytest.mark.parametrize("lookup_after_failed_load", [True, False])
def test_failed_load_not_retried_if_declared(engine, lookup_after_failed_load):
    """LIFE-LOAD-4: a request whose load failed is looked up again, unless the config says it is not; then it
    recomputes its prompt."""
    e = engine(lookup_after_failed_load=lookup_after_failed_load)
    offloaded_then_forgotten(e, PROMPT)
    e.add_request(RequestSpec(request_id="reader", prompt=PROMPT))
    steps = [e.step()]
    e.complete_transfers(True, False)
    steps += [e.step() for _ in range(3)]
    assert [len(step.trace.loads) for step in steps] == [1, 0, int(lookup_after_failed_load), 0]
    assert sum(step.scheduled_tokens.get("reader", 0) for step in steps) == (0 if lookup_after_failed_load else 12)


def test_a_load_failure_from_before_a_connector_reset_is_ignored(engine):
    """OFF-MGR-8, LIFE-LOAD-4: a failed load completing after a connector reset is a stale job; its failure does not
    mark the request, which is looked up again (vLLM 0.34 skips stale completions before it marks load_failed;
    `--profile dev` seed 3 on 0.34 found the reference marking it)."""
    e = engine(lookup_after_failed_load=False)
    offloaded_then_forgotten(e, PROMPT)
    e.add_request(RequestSpec(request_id="reader", prompt=PROMPT))
    e.step()
    e.complete_transfers(True, False)
    e.reset_prefix_cache(reset_connector=True)
    assert any("reader" in e.step().trace.lookups for _ in range(3))


def test_a_request_that_never_ran_offers_nothing_at_finish(engine):
    """OFF-STORE-6: at finish a connector offers only blocks it learned from steps that scheduled the request; one
    aborted while waiting for its load after a connector reset never ran and offers nothing (vLLM 0.34's connector
    learns block ids only from scheduler output; `--profile dev` seeds 4 and 6 found the reference offering)."""
    e = engine(offer_at_finish=True)
    offloaded_then_forgotten(e, PROMPT)
    e.add_request(RequestSpec(request_id="reader", prompt=PROMPT))
    e.step()
    e.reset_prefix_cache(reset_connector=True)
    e.abort("reader")
    assert [e.step().trace.store_offers for _ in range(2)] == [[], []]


def test_delayed_free_released_when_jobs_end(conn):
    """LIFE-FREE-1: a finished request the connector delayed is released once its last job is reported."""
    c, r = pending_full_load(conn)
    job_id = c.build_connector_meta(SchedulerOutput({}, {}, {}, set(), set())).load_jobs[0].job_id
    assert c.request_finished(r) is True
    assert c.update_connector_output(ConnectorOutput({job_id: True})).released == {"r"} and c.manager.num_pinned() == 0


def test_store_flushed_before_blocks_reused(conn):
    """LIFE-FREE-2: an in-flight store is flushed in the step its GPU blocks are reallocated or its request
    preempted."""
    c = conn()
    r, s = req("r"), req("s", (1,) * 8)
    c.on_new_request(r)
    c.on_new_request(s)
    job_id = c.build_connector_meta(sched_output(r, 12, [1, 2, 3])).store_jobs[0].job_id
    c.request_finished(r)
    assert c.build_connector_meta(sched_output(s, 3, [2], allocated=[2])).jobs_to_flush == {job_id}
    store = c.build_connector_meta(sched_output(s, 8, [2, 4])).store_jobs[0].job_id
    assert c.build_connector_meta(sched_output(s, 0, [2, 4], preempted=["s"])).jobs_to_flush == {store}


# --- conformance --------------------------------------------------------------------------------


def test_observations_are_validated():
    """CONF-OBS-1: observations are validated: a negative count or an unknown field is rejected."""
    with pytest.raises(ValidationError):
        StepObservation(scheduled_tokens={}, computed_tokens={}, loads=({"request_id": "r", "offload_indices": (),
                                                                          "first_gpu_block": -1, "num_gpu_blocks": 1},))
    with pytest.raises(ValidationError):
        StepObservation(scheduled_tokens={}, computed_tokens={}, surprise=1)


def test_blockref_identity(engine):
    """CONF-OBS-2: a BlockRef stands for its block's hash; one naming no full offloaded block is a violation."""
    e = engine(block_size_factor=3)
    e.add_request(RequestSpec(request_id="r", prompt=PROMPT + (0,)))
    ctx = Context(e.config, {}, e.requests)
    assert ctx.identity(BlockRef(request_id="r", index=0)) == e.requests["r"].block_hashes[2]
    with pytest.raises(ClauseViolation, match="CONF-OBS-2"):
        ctx.identity(BlockRef(request_id="r", index=1))


def test_adapter_exception_is_call_failure():
    """CONF-CALL-1: an exception raised by the adapter is reported as CONF-CALL-1 naming the call."""
    execution = Execution(Session(ReferenceAdapter))
    execution.caller.adapter = object()
    with pytest.raises(ClauseViolation, match=r"CONF-CALL-1.*adapter\.step"):
        execution.call("step")


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_configs_within_capabilities(data):
    """CONF-CAP-1: the harness draws engine configurations only within the adapter's capabilities."""
    caps = Capabilities(async_scheduling=False, eviction_policies=("arc",), block_size_factors=(2,))
    config = data.draw(engine_configs(caps))
    assert (config.async_scheduling, config.eviction_policy, config.block_size_factor) == (False, "arc", 2)
    scheduling = data.draw(st.sampled_from(["sync", "async"]))
    assert data.draw(engine_configs(Capabilities(), scheduling)).async_scheduling is (scheduling == "async")


def test_programs_do_not_depend_on_imports(monkeypatch, tmp_path):
    """CONF-RUN-4: importing a local module full of constants does not change what a derandomised run draws."""
    monkeypatch.setitem(PROFILES, "short", Profile(max_examples=5, stateful_step_count=20, shrink_attempts=10,
                                                   derandomize=True))
    def drawn():
        result = runner.run(ReferenceAdapter, "reference", "short")
        return result.statistics.rules, result.statistics.steps, dict(result.coverage)
    before = drawn()
    (tmp_path / "adapter_constants.py").write_text(f"SIZES = {list(range(300))}\n"
                                                   f"NAMES = {[f'r{i}' for i in range(50)]}\n")
    monkeypatch.syspath_prepend(tmp_path)
    importlib.import_module("adapter_constants")
    assert drawn() == before


def test_harness_error_is_run_failure(monkeypatch):
    """CONF-RUN-1: a harness (Hypothesis) error fails the run as CONF-RUN-1, not as a pass."""
    def broken(*args, **kwargs):
        raise InvalidArgument("broken settings")
    monkeypatch.setattr(runner, "run_state_machine_as_test", broken)
    result = runner.run(lambda: None, "broken")
    assert (result.passed, result.failed_clause) == (False, "CONF-RUN-1")
