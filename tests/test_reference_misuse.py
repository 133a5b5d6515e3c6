"""Misusing the reference raises one typed error, `InvalidCall`, naming the clause; nothing else escapes.

Hypothesis draws call sequences mixing valid and invalid calls — unknown or finished request ids,
double finishes, negative counts, out-of-range block ids and store rows — against the engine and its
parts. A KeyError, IndexError, AssertionError or torch error would be a reference bug.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.reference.engine import Engine
from kvconform.reference.errors import InvalidCall
from kvconform.reference.kv_cache import BlockPool, KVCacheManager
from kvconform.reference.offload_manager import OffloadManager
from kvconform.reference.request import Request
from kvconform.reference.transfer import TransferEngine

REQUEST_IDS = st.sampled_from(("r0", "r1", "r2", "ghost"))
COUNTS = st.integers(-3, 40)
BLOCK_IDS = st.integers(-2, 20)

ENGINE_CALLS = st.one_of(
    st.tuples(st.just("add_request"), st.builds(
        RequestSpec, request_id=REQUEST_IDS, prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30).map(tuple),
        max_tokens=st.integers(1, 3), skip_reading_prefix_cache=st.booleans())),
    st.tuples(st.sampled_from(("abort", "preempt", "computed_kv")), REQUEST_IDS),
    st.tuples(st.just("reset_prefix_cache"), st.booleans()),
    st.tuples(st.just("complete_transfers"), st.booleans(), st.booleans()),
    st.tuples(st.just("step")),
)


def invalid_or_done(call, *args) -> None:
    """Make the call; an `InvalidCall` naming a clause is the only acceptable failure."""
    try:
        call(*args)
    except InvalidCall as error:
        assert error.clause and str(error).startswith(f"[{error.clause}]"), error


@settings(max_examples=300, deadline=None)
@given(async_scheduling=st.booleans(), calls=st.lists(ENGINE_CALLS, max_size=30))
def test_engine_misuse_raises_invalid_call(async_scheduling: bool, calls: list[tuple]) -> None:
    """LIFE-ADD-1, LIFE-ABORT-1, LIFE-PREEMPT-1: duplicate ids, unknown ids and double finishes are InvalidCall."""
    engine = Engine(EngineConfig(num_gpu_blocks=12, async_scheduling=async_scheduling, num_offload_blocks=2))
    for name, *args in calls:
        invalid_or_done(getattr(engine, name), *args)


POOL_CALLS = st.one_of(
    st.tuples(st.just("allocate"), COUNTS),
    st.tuples(st.sampled_from(("free", "touch")), st.lists(BLOCK_IDS, max_size=4)),
)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(POOL_CALLS, max_size=20))
def test_block_pool_misuse_raises_invalid_call(calls: list[tuple]) -> None:
    """PFX-REF-1, PFX-NULL-1: negative or excessive counts and out-of-range or null blocks are InvalidCall."""
    pool = BlockPool(8)
    for name, *args in calls:
        invalid_or_done(getattr(pool, name), *args)
    assert all(count >= 0 for count in pool.ref_counts) and pool.ref_counts[0] == 0


@settings(max_examples=200, deadline=None)
@given(num_new_tokens=COUNTS, num_external_tokens=COUNTS, computed=st.lists(BLOCK_IDS, max_size=3))
def test_allocate_slots_misuse_raises_invalid_call(num_new_tokens: int, num_external_tokens: int,
                                                   computed: list[int]) -> None:
    """SCHED-ALLOC-1: negative token counts and out-of-range computed blocks are InvalidCall."""
    manager = KVCacheManager(8, 4)
    request = Request("r", tuple(range(4)) * 4, 1, 4)
    invalid_or_done(manager.allocate_slots, request, num_new_tokens, computed, num_external_tokens, False)


KEYS = st.sampled_from((b"k0", b"k1", b"k2", b"k3"))
MANAGER_CALLS = st.one_of(
    st.tuples(st.sampled_from(("prepare_load", "complete_load", "touch", "prepare_store")), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("complete_store"), st.lists(KEYS, max_size=3), st.booleans()),
    st.tuples(st.sampled_from(("lookup",)), KEYS),
    st.tuples(st.just("reset")),
)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=200, deadline=None)
@given(calls=st.lists(MANAGER_CALLS, max_size=25))
def test_offload_manager_misuse_raises_invalid_call(policy: str, calls: list[tuple]) -> None:
    """OFF-MGR-3, OFF-MGR-6: loading, unpinning or completing keys in the wrong state is InvalidCall."""
    manager = OffloadManager(2, policy)
    for name, *args in calls:
        invalid_or_done(getattr(manager, name), *args)
    assert manager.num_pinned() >= 0


@settings(max_examples=200, deadline=None)
@given(gpu_blocks=st.lists(BLOCK_IDS, max_size=3), rows=st.lists(st.integers(-2, 12), max_size=3),
       to_store=st.booleans())
def test_transfer_misuse_raises_invalid_call(gpu_blocks: list[int], rows: list[int], to_store: bool) -> None:
    """XFER-COPY-1: copies between mismatched or out-of-range blocks and store rows are InvalidCall."""
    transfer = TransferEngine(8, 3, 4, 3, 8)
    if to_store:
        invalid_or_done(transfer.copy_to_store, gpu_blocks, rows)
    else:
        invalid_or_done(transfer.copy_to_gpu, rows, gpu_blocks)
