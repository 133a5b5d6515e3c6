"""Transfer execution for the vLLM adapters: real torch copies, held in flight until the harness lets them finish.

vLLM's own transfer code needs CUDA streams, pinned memory and compiled copy kernels (`swap_blocks`, a DMA batch
copy); on a CPU-only machine the adapters replace it with `KVTensors`, a small torch copy of their own that moves
whole GPU blocks between the KV tensor registered with vLLM and a CPU store tensor. It shares no code with the
reference's `TransferEngine`: the byte checks (XFER-DATA-1, KVC-DATA-1) judge the adapter's own byte path against
what the bytes must be, the KV content function, the one part both sides share. A job's bytes are copied when it
finishes, never earlier, so a GPU block overwritten while a store still reads it shows up as corrupt bytes
(XFER-DATA-1) as well as in XFER-SAFE-1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvconform.common.kv_content import KV_DTYPES
from kvconform.common.values import EngineConfig, TransferOutcome


@dataclass(frozen=True)
class Copy:
    """One job's copy: GPU blocks paired with store rows, in the direction of `is_store`."""

    is_store: bool
    gpu_blocks: tuple[int, ...]
    rows: tuple[int, ...]


class KVTensors:
    """The KV bytes of one tensor-parallel rank of a vLLM adapter: the GPU KV tensor `[blocks, block_size, width]`
    registered with that rank's worker-side connector, and the CPU store tensor `[rows, block_size, width]` of
    GPU-block-sized rows that the connector's copies fill.

    A token's KV row is `[token_width]`, the heads of every rank side by side; rank r of `ranks` holds the columns of
    its heads, `columns` (all of them with one rank). The forward writes through a slot mapping (slot = block *
    block_size + offset), as vLLM's `reshape_and_cache` does; a copy moves whole blocks by index, as `swap_blocks`
    does."""

    def __init__(self, config: EngineConfig, store_rows: int, rank: int = 0, ranks: int = 1) -> None:
        dtype = KV_DTYPES[config.kv_dtype]
        width = config.token_width // ranks
        self.columns = slice(rank * width, (rank + 1) * width)
        self.gpu = torch.zeros(config.num_gpu_blocks, config.block_size, width, dtype=dtype)
        self.cpu = torch.zeros(store_rows, config.block_size, width, dtype=dtype)

    @property
    def page_bytes(self) -> int:
        """Return the bytes of one GPU block, the page vLLM's KV cache spec sizes."""
        return self.gpu[0].numel() * self.gpu.element_size()

    def slots(self, gpu_blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Return the slot of each token position `start .. end` of a request whose block table is `gpu_blocks`."""
        positions = torch.arange(start, end)
        block_size = self.gpu.shape[1]
        blocks = torch.tensor(list(gpu_blocks), dtype=torch.int64)[positions // block_size]
        return blocks * block_size + positions % block_size

    def write(self, gpu_blocks: Sequence[int], start: int, rows: torch.Tensor) -> None:
        """Write this rank's columns of the KV rows of token positions `start .. start + len(rows)` into their slots
        (the forward)."""
        self.gpu.view(-1, self.gpu.shape[2])[self.slots(gpu_blocks, start, start + len(rows))] = rows[:, self.columns]

    def read(self, gpu_blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Return this rank's columns `[num_tokens, width]` of a request's first tokens' KV rows, from their slots."""
        return self.gpu.view(-1, self.gpu.shape[2])[self.slots(gpu_blocks, 0, num_tokens)]

    def read_store(self, first_row: int, num_rows: int) -> torch.Tensor:
        """Return this rank's columns `[num_rows * block_size, width]` of the store's rows from `first_row` on."""
        return self.cpu[first_row : first_row + num_rows].reshape(-1, self.cpu.shape[2]).clone()

    def copy(self, copy: Copy) -> None:
        """Copy GPU blocks into store rows (a store) or store rows into GPU blocks (a load), pair by pair."""
        gpu_blocks = torch.tensor(copy.gpu_blocks, dtype=torch.int64)
        rows = torch.tensor(copy.rows, dtype=torch.int64)
        if copy.is_store:
            self.cpu.index_copy_(0, rows, self.gpu.index_select(0, gpu_blocks))
        else:
            self.gpu.index_copy_(0, gpu_blocks, self.cpu.index_select(0, rows))


def store_rows(slots: Iterable[int], factor: int, first_logical_block: int, count: int) -> tuple[int, ...]:
    """Return the store rows of `count` GPU blocks whose first is logical block `first_logical_block` of its
    request, in the offloaded blocks held at `slots` (vLLM's `block_indices` skip, XFER-LOAD-1)."""
    skip = first_logical_block % factor
    rows = [slot * factor + position for slot in slots for position in range(factor)]
    return tuple(rows[skip : skip + count])


class HeldTransfers:
    """Jobs the vLLM worker submitted; each finishes when the harness completes transfers (CONN-STEP-4)
    or when vLLM waits for it (a flush)."""

    def __init__(self, kv_tensors: KVTensors) -> None:
        self.kv_tensors = kv_tensors
        self.held: dict[int, Copy] = {}
        self.issued: dict[int, Copy] = {}
        self.released: dict[int, bool] = {}
        self.finished: list[tuple[int, bool]] = []
        self.this_step: set[int] = set()
        self.completion_at_poll: TransferOutcome | None = None

    def begin_step(self) -> None:
        """Start a new engine step: the jobs issued from now on are this step's."""
        self.this_step = set()

    def issue(self, job_id: int, is_store: bool, gpu_blocks: Iterable[int]) -> None:
        """Note a load or store the scheduler side handed to the worker (it may be submitted a step later)."""
        self.issued[job_id] = Copy(is_store, tuple(gpu_blocks), ())
        self.this_step.add(job_id)

    def submit(self, job_id: int, copy: Copy) -> None:
        """Hold a submitted job, or run it now if the harness already let it finish."""
        if job_id in self.released:
            self._run(job_id, copy, self.released[job_id])
        else:
            self.held[job_id] = copy

    def complete(self, fail_loads: bool = False, fail_stores: bool = False) -> None:
        """Finish every held job now, and every issued one as soon as vLLM submits it; loads and/or stores fail
        (copy nothing) if asked."""
        fails = (fail_loads, fail_stores)
        for job_id in sorted(self.held):
            copy = self.held.pop(job_id)
            self._run(job_id, copy, not fails[copy.is_store])
        for job_id, issued in self.issued.items():
            self.released.setdefault(job_id, not fails[issued.is_store])

    def wait(self, job_ids: Iterable[int]) -> None:
        """Finish the named held jobs now, successfully (vLLM's blocking `wait`, used to flush stores)."""
        for job_id in sorted(set(job_ids) & self.held.keys()):
            self._run(job_id, self.held.pop(job_id), True)

    def complete_at_poll(self, outcome: TransferOutcome | None) -> None:
        """Finish every job with `outcome` when the worker next polls its finished jobs, inside the step."""
        self.completion_at_poll = outcome

    def take_finished(self) -> list[tuple[int, bool]]:
        """Return the jobs finished since the last call, each with its success (the worker's poll)."""
        if self.completion_at_poll is not None:
            outcome, self.completion_at_poll = self.completion_at_poll, None
            self.complete(outcome.fail_loads, outcome.fail_stores)
        finished, self.finished = self.finished, []
        return finished

    def store_reads(self) -> set[int]:
        """Return the GPU blocks that stores issued in earlier steps and not finished will still read (XFER-SAFE-1);
        a store vLLM has not submitted yet reads them once it is. This step's stores follow its forward."""
        return {block for job_id, copy in self.issued.items() if copy.is_store and job_id not in self.this_step
                for block in copy.gpu_blocks}

    def _run(self, job_id: int, copy: Copy, success: bool) -> None:
        if success:
            self.kv_tensors.copy(copy)
        self.issued.pop(job_id, None)
        self.released.pop(job_id, None)
        self.finished.append((job_id, success))


class RankedKV:
    """The KV bytes of every tensor-parallel rank: a write gives each rank its heads' columns, a read joins every
    rank's columns back into `[tokens, token_width]` rows, so the byte checks judge all ranks at once."""

    def __init__(self, config: EngineConfig, store_rows: int, ranks: int) -> None:
        self.ranks: list[Any] = [KVTensors(config, store_rows, rank, ranks) for rank in range(ranks)]
        """Each rank's KV bytes: its `KVTensors`, or its process's (`engine.RankProcess`, which reads them there)."""
        self.dtype: torch.dtype = self.ranks[0].gpu.dtype
        self.page_bytes: int = self.ranks[0].page_bytes
        """The bytes of one GPU block of one rank: the page each rank's KV cache spec sizes."""

    def write(self, gpu_blocks: Sequence[int], start: int, rows: torch.Tensor) -> None:
        for kv in self.ranks:
            kv.write(gpu_blocks, start, rows)

    def read(self, gpu_blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        return torch.cat([kv.read(gpu_blocks, num_tokens) for kv in self.ranks], dim=1)

    def read_store(self, first_row: int, num_rows: int) -> torch.Tensor:
        return torch.cat([kv.read_store(first_row, num_rows) for kv in self.ranks], dim=1)


class RankedTransfers:
    """The held transfers of every tensor-parallel rank, as the harness sees them: each rank's worker-side connector
    submits its own copies of its own heads, the harness completes them all at once, and a job is in flight while any
    rank still holds it."""

    def __init__(self, kv_tensors: Sequence[KVTensors]) -> None:
        self.ranks = [HeldTransfers(tensors) for tensors in kv_tensors]

    @property
    def held(self) -> dict[int, Copy]:
        return {job_id: copy for transfers in self.ranks for job_id, copy in transfers.held.items()}

    def begin_step(self) -> None:
        for transfers in self.ranks:
            transfers.begin_step()

    def issue(self, job_id: int, is_store: bool, gpu_blocks: Iterable[int]) -> None:
        """Note a job the scheduler side handed to the workers: every rank runs it on its own heads."""
        blocks = tuple(gpu_blocks)
        for transfers in self.ranks:
            transfers.issue(job_id, is_store, blocks)

    def complete(self, fail_loads: bool = False, fail_stores: bool = False) -> None:
        for transfers in self.ranks:
            transfers.complete(fail_loads, fail_stores)

    def complete_at_poll(self, outcome: TransferOutcome | None) -> None:
        for transfers in self.ranks:
            transfers.complete_at_poll(outcome)

    def store_reads(self) -> set[int]:
        return set().union(*(transfers.store_reads() for transfers in self.ranks))
