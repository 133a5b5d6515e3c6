"""Real block transfer between the GPU-side KV cache and the offload store (spec chapter `transfer`).

Both sides are torch tensors. The GPU side lives on CUDA when it is available and the store in
pinned CPU memory; otherwise both live on the CPU. One code path serves both (XFER-COPY-1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvconform.common.kv_content import KV_DTYPES
from kvconform.reference.errors import InvalidCall


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TransferEngine:
    """Holds the GPU KV cache `[blocks, block_size, width]` and the store `[slots * factor, block_size, width]`."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_slots: int,
        block_size: int,
        block_size_factor: int,
        token_width: int,
        dtype: str = "float16",
        device: torch.device | None = None,
    ) -> None:
        if dtype not in KV_DTYPES:
            raise InvalidCall("XFER-COPY-1", f"unsupported KV dtype {dtype!r}; use one of {sorted(KV_DTYPES)}")
        self.device = device or default_device()
        self.factor = block_size_factor
        self.block_size = block_size
        self.gpu = torch.zeros(num_gpu_blocks, block_size, token_width, dtype=KV_DTYPES[dtype], device=self.device)
        self.store = torch.zeros(
            num_slots * block_size_factor,
            block_size,
            token_width,
            dtype=KV_DTYPES[dtype],
            pin_memory=self.device.type == "cuda",
        )

    def store_rows(self, slot: int, first: int, count: int) -> list[int]:
        """Return the store rows of GPU-block positions `first .. first+count` inside one offloaded block."""
        return [slot * self.factor + position for position in range(first, first + count)]

    def copy_to_store(self, gpu_blocks: Sequence[int], rows: Sequence[int]) -> None:
        """Copy GPU blocks into store rows (XFER-COPY-1)."""
        self._check_pairing(gpu_blocks, rows)
        copy_blocks(self.store, rows, self.gpu, gpu_blocks)

    def copy_to_gpu(self, rows: Sequence[int], gpu_blocks: Sequence[int]) -> None:
        """Copy store rows into GPU blocks (XFER-COPY-1)."""
        self._check_pairing(gpu_blocks, rows)
        copy_blocks(self.gpu, gpu_blocks, self.store, rows)

    def write_tokens(self, gpu_blocks: Sequence[int], first_position: int, values: torch.Tensor) -> None:
        """Write KV rows for consecutive token positions starting at `first_position`, block by block (XFER-DATA-1)."""
        values = values.to(self.device)
        written = 0
        while written < len(values):
            block, offset = divmod(first_position + written, self.block_size)
            count = min(self.block_size - offset, len(values) - written)
            self.gpu[gpu_blocks[block], offset : offset + count] = values[written : written + count]
            written += count

    def read_tokens(self, gpu_blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Return the KV rows of a request's first `num_tokens` tokens, as stored in its GPU blocks."""
        if num_tokens == 0:
            return self.gpu.new_zeros(0, self.gpu.shape[2]).cpu()
        rows = self.gpu.index_select(0, self._index(gpu_blocks, self.device)).reshape(-1, self.gpu.shape[2])
        return rows[:num_tokens].cpu()

    def read_store(self, slot: int) -> torch.Tensor:
        """Return the KV rows of the offloaded block held at `slot`: its `factor` store rows, token after token."""
        return self.store[slot * self.factor : (slot + 1) * self.factor].reshape(-1, self.store.shape[2]).clone()

    def _check_pairing(self, gpu_blocks: Sequence[int], rows: Sequence[int]) -> None:
        """One store row per GPU block, each in range; block 0 is the null block (XFER-COPY-1, PFX-NULL-1)."""
        if len(gpu_blocks) != len(rows):
            raise InvalidCall("XFER-COPY-1", f"{len(gpu_blocks)} GPU blocks paired with {len(rows)} store rows")
        num_gpu_blocks, num_rows = len(self.gpu), len(self.store)
        if any(not 0 < block < num_gpu_blocks for block in gpu_blocks) or any(not 0 <= row < num_rows for row in rows):
            raise InvalidCall("XFER-COPY-1", f"GPU blocks {list(gpu_blocks)} or store rows {list(rows)} out of range")

    @staticmethod
    def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.as_tensor(list(ids), dtype=torch.int64, device=device)


def copy_blocks(target: torch.Tensor, target_ids: Sequence[int],
                source: torch.Tensor, source_ids: Sequence[int]) -> None:
    """Copy block `source[source_ids[i]]` into `target[target_ids[i]]` for every i (XFER-COPY-1).

    Each run of pairs whose ids are consecutive on both sides is contiguous in both tensors, so it
    moves as one plain copy, with no intermediate tensor; the runs go to torch in one batched call.
    Copies from the GPU into pinned CPU memory are asynchronous; they are all awaited before returning,
    so the bytes are in place when it returns.
    """
    runs = list(consecutive_runs(target_ids, source_ids))
    if not runs:
        return
    torch._foreach_copy_([target[first : first + length] for first, _, length in runs],
                         [source[first : first + length] for _, first, length in runs], non_blocking=True)
    if source.is_cuda and not target.is_cuda:
        torch.cuda.synchronize(source.device)


def consecutive_runs(first_ids: Sequence[int], second_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Yield `(first_id, second_id, length)` for each maximal stretch where both id lists go up by one."""
    start = 0
    for end in range(1, len(first_ids) + 1):
        if (end == len(first_ids) or first_ids[end] != first_ids[end - 1] + 1
                or second_ids[end] != second_ids[end - 1] + 1):
            yield first_ids[start], second_ids[start], end - start
            start = end
