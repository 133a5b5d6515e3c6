"""Transfer execution for the vLLM adapters: real torch copies, held in flight until the harness lets them finish.

vLLM's own transfer code needs CUDA streams, pinned memory and compiled copy kernels; on a CPU-only
machine the adapters replace it with kvconform's torch transfer engine (`reference.transfer`), which
copies whole GPU blocks between the KV tensors registered with vLLM and a CPU store tensor. A job's
bytes are copied when it finishes, never earlier, so a GPU block overwritten while a store still reads
it shows up as corrupt bytes (XFER-DATA-1) as well as in XFER-SAFE-1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvconform.common.values import TransferOutcome
from kvconform.reference.transfer import TransferEngine


@dataclass(frozen=True)
class Copy:
    """One job's copy: GPU blocks paired with store rows, in the direction of `is_store`."""

    is_store: bool
    gpu_blocks: tuple[int, ...]
    rows: tuple[int, ...]


def store_rows(slots: Iterable[int], factor: int, first_logical_block: int, count: int) -> tuple[int, ...]:
    """Return the store rows of `count` GPU blocks whose first is logical block `first_logical_block` of its
    request, in the offloaded blocks held at `slots` (vLLM's `block_indices` skip, XFER-LOAD-1)."""
    skip = first_logical_block % factor
    rows = [slot * factor + position for slot in slots for position in range(factor)]
    return tuple(rows[skip : skip + count])


class HeldTransfers:
    """Jobs the vLLM worker submitted; each finishes when the harness completes transfers (CONN-STEP-4)
    or when vLLM waits for it (a flush)."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
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
        if success and copy.is_store:
            self.engine.copy_to_store(copy.gpu_blocks, copy.rows)
        elif success:
            self.engine.copy_to_gpu(copy.rows, copy.gpu_blocks)
        self.issued.pop(job_id, None)
        self.released.pop(job_id, None)
        self.finished.append((job_id, success))
