"""The seam in vLLM's OffloadingConnector: its real CPU offloading spec, with kvconform executing the transfers.

vLLM's OffloadingSpecFactory imports this module (`spec_module_path` in the connector's extra config), so
importing it imports vLLM. `KVConformCPUOffloadingSpec` is vLLM's `CPUOffloadingSpec` — same CPU block
count, same `CPUOffloadingManager` with its LRU or ARC policy — except that the worker side hands the
transfers to kvconform (`transfers.HeldTransfers`) instead of vLLM's CUDA copy kernels: through
`get_handlers` (an `OffloadingHandler`) up to 0.24 and `get_worker` (an `OffloadingWorker`) from 0.32.

`TorchCopyCPUOffloadingSpec` (0.32+) is the same spec for a real engine on the CPU (`live.py`), where vLLM's CPU
worker refuses to run without CUDA: its worker copies the engine's own KV tensors with torch, each job at once, and
reports it finished at the connector's next poll, on the engine's clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvconform.adapters.vllm import runtime
from kvconform.adapters.vllm.transfers import Copy, HeldTransfers, store_rows


class Session(Protocol):
    """What the adapter that built the engine offers the spec: its seam (`offloading.OffloadingSeam`)."""

    @property
    def transfers(self) -> HeldTransfers: ...

    def spec_built(self, spec: CPUOffloadingSpec) -> None: ...

    def manager_built(self, manager: base.OffloadingManager) -> None: ...


SESSIONS: dict[str, Session] = {}
"""Seams by the `kvconform_session` key of the extra config they built the engine with."""


class KVConformCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec whose transfers kvconform executes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.session = SESSIONS[self.extra_config["kvconform_session"]]
        self.session.spec_built(self)

    def get_manager(self) -> base.OffloadingManager:
        manager = super().get_manager()
        self.session.manager_built(manager)
        return manager

    def get_handlers(self, kv_caches: Any) -> Iterator[tuple[type, type, Any]]:
        """Up to 0.24: one handler per direction (here one for both)."""
        handler = TransferHandler(self.session.transfers, self.block_size_factor)
        yield base.GPULoadStoreSpec, CPULoadStoreSpec, handler
        yield CPULoadStoreSpec, base.GPULoadStoreSpec, handler

    def get_worker(self, kv_caches: Any) -> Any:
        """0.32+: one worker for the CPU medium, addressed by device pointers."""
        return TransferWorker(self.session.transfers, self.blocks_per_chunk, kv_caches.tensors[0].tensor)


def copy_of(gpu: Any, cpu: Any, factor: int, is_store: bool, gpu_blocks: tuple[int, ...] | None = None) -> Copy:
    """Return the copy between the GPU blocks of `gpu` (or `gpu_blocks`) and the CPU blocks of `cpu`."""
    (first_block,) = gpu.block_indices
    gpu_blocks = gpu_blocks if gpu_blocks is not None else tuple(int(b) for b in gpu.block_ids)
    return Copy(is_store, gpu_blocks, store_rows((int(s) for s in cpu.block_ids), factor, int(first_block),
                                                 len(gpu_blocks)))


def results(transfers: HeldTransfers, result_class: type) -> list[Any]:
    return [runtime.dataclass_kwargs(result_class, job_id=job_id, success=success)
            for job_id, success in transfers.take_finished()]


if hasattr(base, "OffloadingWorker"):  # 0.32+

    class TorchCopyWorker(base.OffloadingWorker):
        """An OffloadingWorker that copies whole blocks between a real engine's KV tensors (`[blocks, page bytes]`,
        int8, one per layer) and a CPU store of as many rows per tensor as the spec's chunks hold."""

        def __init__(self, kv_caches: Any, factor: int, rows: int) -> None:
            self.gpu = [entry.tensor for entry in kv_caches.tensors]
            self.store = [torch.zeros(rows, *tensor.shape[1:], dtype=tensor.dtype) for tensor in self.gpu]
            self.factor = factor
            self.finished: list[int] = []

        def _copy(self, job_id: int, copy: Copy) -> bool:
            blocks = torch.tensor(copy.gpu_blocks, dtype=torch.int64)
            rows = torch.tensor(copy.rows, dtype=torch.int64)
            for gpu, store in zip(self.gpu, self.store, strict=True):
                if copy.is_store:
                    store.index_copy_(0, rows, gpu.index_select(0, blocks))
                else:
                    gpu.index_copy_(0, blocks, store.index_select(0, rows))
            self.finished.append(job_id)
            return True

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            return self._copy(job_id, copy_of(src_spec, dst_spec, self.factor, True))

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
            return self._copy(job_id, copy_of(dst_spec, src_spec, self.factor, False))

        def get_finished(self) -> list[Any]:
            finished, self.finished = self.finished, []
            return [runtime.dataclass_kwargs(base.TransferResult, job_id=job_id, success=True) for job_id in finished]

        def wait(self, job_ids: set[int]) -> None:
            """Every job is copied when submitted."""

    class TorchCopyCPUOffloadingSpec(CPUOffloadingSpec):
        """vLLM's CPU offloading spec (its manager, LRU or ARC, and chunking), its worker copying with torch."""

        def get_worker(self, kv_caches: Any) -> Any:
            worker: Any = getattr(self, "_worker", None)  # vLLM's attribute, untyped where vLLM is not installed
            if worker is None:
                worker = self._worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk,
                                                        self.num_chunks * self.blocks_per_chunk)
            return worker

    class TransferWorker(base.OffloadingWorker):
        """An OffloadingWorker backed by `HeldTransfers`; device pointers are mapped back to GPU block ids."""

        def __init__(self, transfers: HeldTransfers, factor: int, gpu_blocks: Any) -> None:
            self.transfers = transfers
            self.factor = factor
            self.base_pointer = gpu_blocks.data_ptr()
            self.block_bytes = gpu_blocks.stride(0) * gpu_blocks.element_size()

        def block_ids(self, gpu: Any) -> tuple[int, ...]:
            """The GPU block ids of a job: 0.32 names them (a GPULoadStoreSpec), 0.34+ gives device pointers."""
            if isinstance(gpu, base.GPULoadStoreSpec):
                assert len(gpu.group_sizes) == 1, "one KV cache group only"
                return tuple(int(b) for b in gpu.block_ids)
            (count,) = gpu.group_data_ref_counts
            assert count == 1, "one KV layer only"
            return tuple((int(p) - self.base_pointer) // self.block_bytes for p in gpu.ptrs)

        def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
            self.transfers.submit(job_id,
                                  copy_of(device_ptrs, dst_spec, self.factor, True, self.block_ids(device_ptrs)))
            return True

        def submit_load(self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False) -> bool:
            self.transfers.submit(job_id,
                                  copy_of(device_ptrs, src_spec, self.factor, False, self.block_ids(device_ptrs)))
            return True

        def get_finished(self) -> list[Any]:
            return results(self.transfers, base.TransferResult)

        def wait(self, job_ids: set[int]) -> None:
            self.transfers.wait(job_ids)

else:  # up to 0.24
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult

    class TransferHandler(OffloadingHandler):
        """An OffloadingHandler for both directions, backed by `HeldTransfers`."""

        def __init__(self, transfers: HeldTransfers, factor: int) -> None:
            self.transfers = transfers
            self.factor = factor

        def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
            source, destination = spec
            is_store = isinstance(source, base.GPULoadStoreSpec)
            gpu, cpu = (source, destination) if is_store else (destination, source)
            self.transfers.submit(job_id, copy_of(gpu, cpu, self.factor, is_store))
            return True

        def get_finished(self) -> list[Any]:
            return results(self.transfers, TransferResult)

        def wait(self, job_ids: set[int]) -> None:
            self.transfers.wait(job_ids)
