"""A correct `KVConnectorBase_V1` on its own clock, and its buggy twins: the test double of the connector level
(chapter `connector-level`, issue 22), for vLLM 0.24 and 0.34.

Loads and saves complete on background threads after a random latency, as LMCache's or NIXL's do: the kit cannot
complete them, only step the engine while they run, as vLLM's engine core does. Asynchronous loads are reported by
`get_finished` — some in the very step that started them. The store is CPU block KV keyed by the request's tenant
(cache_salt, LoRA name) and the token prefix the block ends, never evicted; the scheduler side and the worker side of
one engine share it through the `shared_storage_path` the adapter gives each engine, a file per block, in whatever
processes they run. A save copies the block's bytes when the forward ends and makes them readable later; a request
with a save scheduled delays its free until the worker has written every save of it. With tensor parallelism each rank's
worker keeps its own share of the heads under its rank, and a block is a hit once every rank has saved it.

    kvconform run --adapter vllm-connector --connector tests.own_clock_connector:OwnClockConnector

The twins each put one bug back, and each is killed by its clause (`tests/test_own_clock.py`).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

MAX_LATENCY = 0.004
"""Seconds a transfer may take on its thread; one in four loads ends inside `start_load_kv`, in the step it began."""

Key = tuple[Any, ...]


@dataclass
class Transfer:
    """Blocks of one request to move: GPU block `block_ids[i]` holds the KV of store key `keys[i]`."""

    request_id: str
    block_ids: list[int]
    keys: list[Key]


@dataclass
class OwnClockMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    freed_at_once: list[str] = field(default_factory=list)
    """Finished requests with saves whose free was not delayed: their saves are not to be reported."""


class Store:
    """Block KV by rank and key in one engine's `shared_storage_path`, a file per block, shared by the engine's
    scheduler side and its ranks' workers in whatever processes they run; a block appears whole (written, then
    renamed into place)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def path(self, rank: int, key: Key) -> Path:
        return self.directory / f"{rank}-{hashlib.sha256(repr(key).encode()).hexdigest()}.pt"

    def put(self, rank: int, key: Key, block: dict[str, torch.Tensor]) -> None:
        path = self.path(rank, key)
        partial = path.with_name(f"{path.name}.{threading.get_ident()}.partial")
        torch.save(block, partial)
        os.replace(partial, path)

    def get(self, rank: int, key: Key) -> dict[str, torch.Tensor]:
        return torch.load(self.path(rank, key))

    def leading_hits(self, keys: list[Key], ranks: int) -> int:
        """Return how many of `keys`, from the first, every one of `ranks` ranks has saved."""
        return next((i for i, key in enumerate(keys) if any(not self.path(rank, key).exists()
                                                             for rank in range(ranks))), len(keys))


def store_of(vllm_config: Any) -> Store:
    return Store(vllm_config.kv_transfer_config.get_from_extra_config("shared_storage_path", ""))


class OwnClockConnector(KVConnectorBase_V1):
    """Both roles; the scheduler side answers from the store, the worker side moves bytes on threads."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.store = store_of(vllm_config)
        self.rank = vllm_config.parallel_config.rank
        self.ranks = vllm_config.parallel_config.tensor_parallel_size
        # scheduler side
        self.requests: dict[str, Any] = {}
        self.local_hits: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.saved_blocks: dict[str, int] = {}
        self.saving: set[str] = set()
        self.loading: set[str] = set()
        self.freed_at_once: list[str] = []
        self.new_loads: list[Transfer] = []
        # worker side
        self.layers: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.loaded: list[str] = []
        self.saves_pending: dict[str, int] = {}
        self.finishing: set[str] = set()
        self.not_delayed: set[str] = set()
        self.thread_error: BaseException | None = None

    # --- scheduler side ---------------------------------------------------------------------

    def tenant(self, request: Any) -> Key:
        lora = getattr(request, "lora_request", None)
        return (request.cache_salt, lora.lora_name if lora is not None else None)

    def keys(self, request: Any, num_tokens: int) -> list[Key]:
        """Return the keys of the request's blocks that `num_tokens` tokens fill: each chains the one before."""
        tokens, keys, key = request.all_token_ids, [], self.tenant(request)
        for end in range(self.block_size, num_tokens + 1, self.block_size):
            key = (key, tuple(tokens[end - self.block_size:end]))
            keys.append(key)
        return keys

    def skips_read(self, request: Any) -> bool:
        return bool(getattr(request, "skip_reading_prefix_cache", False) or
                    getattr(request, "skip_reading_external_kv", False))

    def hit_tokens(self, request: Any) -> int:
        """Return the tokens of the longest stored prefix; at least one token is left to compute."""
        return self.store.leading_hits(self.keys(request, request.num_tokens - 1), self.ranks) * self.block_size

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.requests[request.request_id] = request
        self.local_hits[request.request_id] = num_computed_tokens
        if self.skips_read(request):
            return 0, False
        external = self.hit_tokens(request) - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        local = self.local_hits[request.request_id]
        self.loading.add(request.request_id)
        first, end = local // self.block_size, (local + num_external_tokens) // self.block_size
        self.new_loads.append(Transfer(request.request_id, list(blocks.get_block_ids()[0][first:end]),
                                       self.keys(request, local + num_external_tokens)[first:end]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = OwnClockMetadata(loads=self.new_loads, freed_at_once=self.freed_at_once)
        self.new_loads, self.freed_at_once = [], []
        for new in scheduler_output.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
            self.schedule_saves(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if request_id in resumed:
                self.block_ids[request_id] = list(new_blocks[0])
            elif new_blocks is not None:
                self.block_ids[request_id] += new_blocks[0]
            self.schedule_saves(meta, request_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def schedule_saves(self, meta: OwnClockMetadata, request_id: str, computed_before: int, output: Any) -> None:
        """Save the blocks the step fills whose tokens are all known (async scheduling may not know the last yet)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        computed = min(computed_before + output.num_scheduled_tokens[request_id], len(request.all_token_ids))
        keys = self.keys(request, computed)
        first, end = self.saved_blocks.get(request_id, 0), len(keys)
        if end <= first:
            return
        meta.saves.append(Transfer(request_id, self.block_ids[request_id][first:end], keys[first:end]))
        self.saved_blocks[request_id] = end
        self.saving.add(request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        self.loading -= set(connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free of a request with saves: the worker ends it once it has written them all. Not while its load
        is in flight: vLLM then frees the blocks when the load is reported, and a second report would find no
        request (`Scheduler._update_from_kv_xfer_finished`); its saves' bytes were copied when they were made."""
        request_id = request.request_id
        for state in (self.requests, self.local_hits, self.block_ids, self.saved_blocks):
            state.pop(request_id, None)
        delay = request_id in self.saving and request_id not in self.loading
        if request_id in self.saving and not delay:
            self.freed_at_once.append(request_id)
        self.saving.discard(request_id)
        return delay, None

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OwnClockMetadata)
        with self.lock:
            self.not_delayed |= set(meta.freed_at_once)
            for save in meta.saves:
                self.saves_pending[save.request_id] = self.saves_pending.get(save.request_id, 0) + 1
        for load in meta.loads:
            if random.random() < 0.25:
                self.load(load)
            else:
                self.on_thread(self.load, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        """Copy the saved blocks' bytes now, while the request holds them; they become readable on the thread."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, OwnClockMetadata)
        for save in meta.saves:
            copies = {name: kv[save.block_ids].clone() for name, kv in self.layers.items()}
            self.on_thread(self.save, save, copies)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self.lock:
            if self.thread_error is not None:
                raise RuntimeError("a transfer thread failed") from self.thread_error
            loaded, self.loaded = set(self.loaded), []
            self.finishing |= {r for r in finished_req_ids if r in self.saves_pending and r not in self.not_delayed}
            saved = {r for r in self.finishing if not self.saves_pending[r]}
            self.finishing -= saved
            for request_id in saved:
                del self.saves_pending[request_id]
        return saved or None, loaded or None

    def on_thread(self, transfer: Any, *args: Any) -> None:
        """Run `transfer(*args)` on a thread of its own after a random latency; an error is raised by get_finished."""
        def run() -> None:
            try:
                transfer(*args)
            except BaseException as error:  # the worker reports it at its next get_finished
                with self.lock:
                    self.thread_error = error
        threading.Timer(random.uniform(0, MAX_LATENCY), run).start()

    def load(self, load: Transfer) -> None:
        self.copy(load)
        self.report_loaded(load)

    def copy(self, load: Transfer) -> None:
        blocks = [self.store.get(self.rank, key) for key in load.keys]
        for name, kv in self.layers.items():
            kv[load.block_ids] = torch.stack([block[name] for block in blocks])

    def report_loaded(self, load: Transfer) -> None:
        with self.lock:
            self.loaded.append(load.request_id)

    def save(self, save: Transfer, copies: dict[str, torch.Tensor]) -> None:
        for index, key in enumerate(save.keys):
            self.store.put(self.rank, key, {name: rows[index].clone() for name, rows in copies.items()})
        with self.lock:
            self.saves_pending[save.request_id] -= 1


# --- the twins: one bug each -------------------------------------------------------------------


class ReportsLoadBeforeCopy(OwnClockConnector):
    """Reports a load finished before its bytes are copied (KVC-DATA-1)."""

    def load(self, load: Transfer) -> None:
        self.report_loaded(load)
        time.sleep(MAX_LATENCY)
        self.copy(load)


class ReportsLoadTwice(OwnClockConnector):
    """Reports every load finished again at the next `get_finished` (KVC-ASYNC-1)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        again = getattr(self, "reported", set())
        saved, loaded = super().get_finished(finished_req_ids)
        self.reported = set(loaded or ())
        return saved, (set(loaded or ()) | again) or None


class TenantBlindKey(OwnClockConnector):
    """Keys blocks by tokens alone: one tenant's KV is offered to another (KVC-HIT-1)."""

    def tenant(self, request: Any) -> Key:
        return ()


class AnswersPastThePrompt(OwnClockConnector):
    """Stores the partial last block and counts it whole: the answer covers tokens the request does not have
    (KVC-MATCH-1)."""

    def keys(self, request: Any, num_tokens: int) -> list[Key]:
        tokens, keys, key = request.all_token_ids, [], self.tenant(request)
        for start in range(0, num_tokens, self.block_size):
            key = (key, tuple(tokens[start:min(start + self.block_size, num_tokens)]))
            keys.append(key)
        return keys

    def hit_tokens(self, request: Any) -> int:
        return self.store.leading_hits(self.keys(request, request.num_tokens), self.ranks) * self.block_size


class LoadsAllSynchronously(OwnClockConnector):
    """Offers a stored prompt whole, as a synchronous load: no token is left to compute (KVC-MATCH-1)."""

    def hit_tokens(self, request: Any) -> int:
        return self.store.leading_hits(self.keys(request, request.num_tokens), self.ranks) * self.block_size

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return super().get_num_new_matched_tokens(request, num_computed_tokens)[0], False


class IgnoresSkipRead(OwnClockConnector):
    """Answers a request that must not read cached KV like any other (KVC-SKIP-1 where the release trusts the
    connector: vLLM 0.23, 0.24)."""

    def skips_read(self, request: Any) -> bool:
        return False


class LoadThreadRaises(OwnClockConnector):
    """Its store goes away under a load: the thread's error surfaces at the next `get_finished` (CONF-CALL-1, with the
    thread's traceback)."""

    def copy(self, load: Transfer) -> None:
        raise OSError("the store server went away")
