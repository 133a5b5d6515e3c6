"""A correct `KVConnectorBase_V1` that keeps its store in per-process module state (issue 38 item 1).

Each worker process keeps the KV it saved in `PROCESS_STORE`, a module dict keyed by the block's key alone (its
tenant and the token prefix it ends), as LMCache's engine builder keeps one engine per process: in vLLM each
tensor-parallel rank's worker is a process of its own, so each rank's store holds that rank's heads and nothing
else. The scheduler side never reads the workers' store (it is in another process); it answers from its own index
of the blocks it has had saved, and as its saves and loads run inside the worker's step (`wait_for_save`,
`start_load_kv`, no threads), a block it indexed in one step is in every rank's store before any later step loads
it.

It is correct in vLLM at any tensor-parallel size. Run with every rank in one process, rank 1 would read the heads
rank 0 saved under the same key: the false alarm the kit's rank processes remove.

    kvconform run --adapter vllm-connector --connector tests.process_state_connector:ProcessStateConnector \\
        --tensor-parallel-size 2
"""

from __future__ import annotations

from typing import Any

import torch

from tests.own_clock_connector import Key, OwnClockConnector, OwnClockMetadata, Transfer

PROCESS_STORE: dict[Key, dict[str, torch.Tensor]] = {}
"""This process's saved blocks: key -> layer name -> the block's KV, the heads of this process's rank."""


class ProcessStateConnector(OwnClockConnector):
    """The own-clock double's protocol, its transfers run in the worker's step, its store this process's."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.index: set[Key] = set()
        """Scheduler side: the keys whose saves it has handed to the workers."""

    def hit_tokens(self, request: Any) -> int:
        keys = self.keys(request, request.num_tokens - 1)
        return next((i for i, key in enumerate(keys) if key not in self.index), len(keys)) * self.block_size

    def schedule_saves(self, meta: OwnClockMetadata, request_id: str, computed_before: int, output: Any) -> None:
        before = len(meta.saves)
        super().schedule_saves(meta, request_id, computed_before, output)
        for save in meta.saves[before:]:
            self.index.update(save.keys)

    def on_thread(self, transfer: Any, *args: Any) -> None:
        """No threads: each transfer runs now, in the worker's call."""
        transfer(*args)

    def copy(self, load: Transfer) -> None:
        for name, kv in self.layers.items():
            kv[load.block_ids] = torch.stack([PROCESS_STORE[key][name] for key in load.keys])

    def save(self, save: Transfer, copies: dict[str, torch.Tensor]) -> None:
        for index, key in enumerate(save.keys):
            PROCESS_STORE[key] = {name: rows[index] for name, rows in copies.items()}
        with self.lock:
            self.saves_pending[save.request_id] -= 1
