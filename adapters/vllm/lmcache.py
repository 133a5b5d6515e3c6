"""LMCache's `LMCacheConnectorV1` on CPU: the seam `vllm-connector` gives it (lmcache 0.5.6, vLLM 0.24.0).

LMCache runs in this process, both roles: its scheduler side asks its worker side's lookup server (ZMQ, in-process)
how many tokens it holds, and its worker side stores the KV of each chunk of `chunk_size` tokens in a local CPU
backend (no server). vLLM's `LMCacheConnectorV1` imports LMCache's own implementation
(`lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl`); all of it runs as shipped. Two things a
CPU-only worker lacks are supplied here, outside LMCache's code:

- the worker's distributed state (world size 1, `runtime.single_worker_group`): LMCache's worker asks for its
  tensor-parallel group;
- the copy between vLLM's paged KV tensors and LMCache's memory objects. LMCache's CUDA kernels cannot load on CPU
  torch and its pure-torch paths take over elsewhere, but its connector factory has no CPU copy
  (`CreateGPUConnector` raises "No supported cpu connector found", v1/gpu_connector/__init__.py:247):
  `TorchPagedCopy` is one, in torch, installed in that factory's place for vLLM on CPU.

`TorchPagedCopy`'s layout: the kit's KV tensor has one layer, `[blocks, block_size, token_width]`, token `t` of a
sequence in slot `slot_mapping[t]` (row `block * block_size + offset`), its K the first half of the row and its V
the second. LMCache sizes a chunk's memory object from vLLM's model config (`[2, layers, tokens, heads * head_size]`,
KV_2LTD): a token's K goes to `[0, 0, t, :token_width // 2]`, its V to `[1, 0, t, :token_width // 2]`, the rest of
the object is zero. The bytes LMCache stores, looks up and loads are exactly the kit's; the padding never reaches a
GPU block.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from kvconform.adapters.registry import AdapterNotFound
from kvconform.adapters.vllm import runtime
from kvconform.adapters.vllm.engine import TransferSeam, VllmAdapter
from kvconform.common.values import EngineConfig

INSTALL = ("pip install --no-deps lmcache==0.5.6 && pip install numba==0.68.1 aiofile==3.12.3 fastapi==0.165.0 "
           "uvicorn==0.55.0")
"""LMCache 0.5.6 and the packages its vLLM integration imports on CPU, measured over vLLM 0.24.0 (`kvconform
install-vllm 0.24.0`) and torch 2.13.0: the wheel's own pins want CUDA builds (cupy, cuda-python, nvtx) and servers
this set-up never starts."""

LMCACHE_ENVIRONMENT = {"LMCACHE_LOG_LEVEL": "CRITICAL", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
"""LMCache's own switches, set unless the user set them: only critical errors on stderr (it logs an error for each
engine built after the first in one process), no usage reports, no banner."""

CHUNK_TOKENS = 16
"""LMCache's chunk size here (its default is 256): prompts of the kit's programs span a few chunks."""


class LMCacheSeam(TransferSeam):
    """LMCacheConnectorV1 with its local CPU backend, in-process, copying with `TorchPagedCopy`."""

    in_rank_processes = False
    """Its close reaches into the worker-side connector in the adapter's process (LMCache runs at one rank)."""

    def __init__(self, adapter: VllmAdapter) -> None:
        if importlib.util.find_spec("lmcache") is None:
            raise AdapterNotFound(f"LMCacheConnectorV1 needs lmcache, which is not installed: {INSTALL}")
        self.adapter = adapter
        for variable, value in LMCACHE_ENVIRONMENT.items():
            os.environ.setdefault(variable, value)

    def capabilities(self) -> dict[str, Any]:
        """One rank: LMCache's worker asks for its tensor-parallel process group (`get_tp_group()`,
        lmcache_integration/vllm_v1_adapter.py:544), which ranks run in one process do not have
        (`runtime.NeedsProcessGroup`)."""
        return {"tensor_parallel_sizes": (1,)}

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """Return LMCache's settings (`lmcache.` keys of the extra config): local CPU backend only, no HTTP server."""
        return {"lmcache.chunk_size": CHUNK_TOKENS, "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.05,
                "lmcache.internal_api_server_enabled": False}

    def prepare_worker(self) -> None:
        from lmcache.v1 import gpu_connector

        runtime.single_worker_group()
        if not isinstance(gpu_connector.CreateGPUConnector, CPUConnectorFactory):
            gpu_connector.CreateGPUConnector = CPUConnectorFactory(gpu_connector.CreateGPUConnector)

    def close(self) -> None:
        """Stop what LMCache started for this engine and destroy its engine, which LMCache keeps process-wide by name
        (`LMCacheEngineBuilder`): otherwise the next engine of this process finds this one's store, and every engine
        leaves two server threads and their sockets behind. LMCache's own `LMCacheManager.stop_services` cannot be
        used in one process: it closes the offload server's socket from another thread while the server blocks in
        `recv` on it (v1/offload_server/zmq_server.py), which aborts the process in libzmq, and the lookup client
        terminates the process-wide ZMQ context the worker's sockets still use (v1/rpc/zmq_transport.py)."""
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        if self.adapter.worker is None:  # the engine was never built
            return
        worker = self.adapter.worker._lmcache_engine._manager
        stop_server(worker._lookup_server, worker._lookup_server.transport.socket)
        worker._lookup_server.transport.ctx.term()
        stop_server(worker._offload_server, worker._offload_server.socket)
        LMCacheEngineBuilder.destroy(ENGINE_NAME)
        for socket in self.adapter.scheduler.connector._lmcache_engine._manager._lookup_client.transport.sockets:
            socket.close(linger=0)


def stop_server(server: Any, socket: Any) -> None:
    """Stop an LMCache server thread that serves `socket`: clear its `running` flag, wake its `recv` with one
    message (it answers none, the flag being down), wait for the thread, then close the socket from here."""
    import zmq

    server.running = False
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with context.socket(zmq.REQ) as waker:
        waker.setsockopt(zmq.LINGER, 0)
        waker.connect(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        waker.send(b"stop")
        server.thread.join()
    socket.close(linger=0)


class CPUConnectorFactory:
    """LMCache's `CreateGPUConnector`, answering `TorchPagedCopy` for vLLM on CPU and LMCache's own answer otherwise."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        from lmcache import torch_device_type
        from lmcache.utils import EngineType

        if engine == EngineType.VLLM and torch_device_type == "cpu":
            return TorchPagedCopy(metadata.kv_shape)
        return self.original(config, metadata, engine, layout_hints=layout_hints)


class TorchPagedCopy:
    """The copy between vLLM's paged KV tensor and LMCache's memory objects, in torch (layout: module docstring).

    It is LMCache's `GPUConnectorInterface` (v1/gpu_connector/gpu_connectors.py) for one KV layer on CPU; every call
    gets the whole sequence's `slot_mapping` and copies the tokens `start:end` of it.
    """

    def __init__(self, kv_shape: tuple[int, ...]) -> None:
        self.num_layers, _, _, num_heads, head_size = kv_shape
        self.hidden = num_heads * head_size

    @staticmethod
    def _token_rows(start: int, end: int, kvcaches: list[torch.Tensor], slot_mapping: torch.Tensor,
                    **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the KV tensor as one row per slot, and the slots of tokens `start:end`."""
        (layer,) = kvcaches
        return layer.reshape(-1, layer.shape[-1]), slot_mapping[start:end].long()

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens `start:end` from their slots into `memory_obj`."""
        from lmcache.v1.memory_management import MemoryFormat

        rows, slots = self._token_rows(start, end, **kwargs)
        half = rows.shape[-1] // 2
        tensor = memory_obj.tensor
        tensor.zero_()
        tensor[0, 0, :, :half] = rows[slots, :half]
        tensor[1, 0, :, :half] = rows[slots, half:]
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy `memory_obj` into the slots of tokens `start:end`, but those vLLM already holds (`vllm_cached_tokens`),
        as LMCache's CUDA copy skips them (`skip_prefix_n_tokens`)."""
        rows, slots = self._token_rows(start, end, **kwargs)
        half = rows.shape[-1] // 2
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        tensor = memory_obj.tensor
        rows[slots[skip:]] = torch.cat((tensor[0, 0, skip:, :half], tensor[1, 0, skip:, :half]), dim=-1)

    def batched_from_gpu(self, memory_objs: list[Any], starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: list[Any], starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])
