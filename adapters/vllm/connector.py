"""`vllm-connector`: any vLLM `KVConnectorBase_V1`, judged at the connector level with no code of the vendor's.

The connector is named by `KVCONFORM_CONNECTOR` — a name vLLM's `KVConnectorFactory` knows (`ExampleConnector`,
`OffloadingConnector`, …) or `module:Class`, the module found from the current directory too and refused before
vLLM is imported when it is nowhere — with its `kv_connector_extra_config` as JSON in
`KVCONFORM_CONNECTOR_CONFIG`; `kvconform run --connector … --connector-config …` and the pytest plugin's
`--kv-connector …` set them. Both roles run around a real vLLM scheduler (`engine.VllmAdapter`), in this process
at one rank; past one, each rank's worker side runs in a process of its own (`engine.RANKS`, `--ranks`), and the model
runner glue calls the connector as vLLM's attention layers do, layer by layer. What the connector
claims (`KVCONFORM_CONNECTOR_MANIFEST`, a JSON object of `Capabilities` fields) defaults to what any connector
inside vLLM can be asked: async scheduling, aborts, no failure injection, no connector reset, no preemption from
outside. Only the connector level's observations are reported: the connector is a black box, on its own clock:
its transfers finish when its threads finish them (`Capabilities.harness_completes_transfers` False), and the kit
steps the engine until it is idle or a deadline passes.

vLLM's own CPU offloading connectors copy with CUDA kernels on their worker side. Named by their factory name,
`OffloadingConnector` and `SimpleCPUOffloadConnector` get the CPU transfer seam of their white-box adapters (`SEAMS`):
vLLM's code throughout, the kit's torch copies in place of the kernels, transfers finishing when the harness completes
them (the deterministic mode, `harness_completes_transfers`); `LMCacheConnectorV1` gets a torch copy for LMCache
(`lmcache.py`). The seam's extra config comes first and `KVCONFORM_CONNECTOR_CONFIG` overrides any field of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from kvconform.adapters.registry import AdapterNotFound, on_path_from_current_directory
from kvconform.adapters.vllm.engine import TransferSeam, VllmAdapter, ranks_in_processes
from kvconform.adapters.vllm.lmcache import LMCacheSeam
from kvconform.adapters.vllm.offloading import OffloadingSeam
from kvconform.adapters.vllm.simple_cpu import SimpleCPUSeam
from kvconform.common.values import Capabilities, EngineConfig

CONNECTOR = "KVCONFORM_CONNECTOR"
CONNECTOR_CONFIG = "KVCONFORM_CONNECTOR_CONFIG"
CONNECTOR_MANIFEST = "KVCONFORM_CONNECTOR_MANIFEST"

DEFAULT_MANIFEST = {"async_scheduling": True, "eviction_policies": ("lru",), "block_size_factors": (1,),
                    "transfer_failures": False, "reset_connector": False, "harness_completes_transfers": False,
                    "tensor_parallel_sizes": (1, 2)}
"""What a connector is asked for unless its seam or manifest says more: its store's policy and chunking are its own,
and so is its clock: its transfers finish when its own threads finish them, unless a seam holds them. It runs with
one rank and with two, each holding its share of the KV heads, as vLLM's workers do."""

SEAMS: dict[str, Callable[[VllmAdapter], TransferSeam]] = {"OffloadingConnector": OffloadingSeam,
                                                            "SimpleCPUOffloadConnector": SimpleCPUSeam,
                                                            "LMCacheConnectorV1": LMCacheSeam}
"""The CPU seams of connectors whose workers copy with CUDA, by factory name (`lmcache.py` for LMCache's)."""


class VllmConnectorAdapter(VllmAdapter):
    """A real vLLM scheduler with the connector named in the environment, judged as a black box."""

    name = "vllm-connector"
    default_connector = ""
    """The connector run when none is named (none: vllm-connector needs one)."""

    def __init__(self) -> None:
        self.connector_spec = os.environ.get(CONNECTOR) or self.default_connector
        if not self.connector_spec:
            raise AdapterNotFound(f"vllm-connector needs a connector: --connector NAME|module:Class (or {CONNECTOR})")
        self.connector_config = _json_object(CONNECTOR_CONFIG, os.environ.get(CONNECTOR_CONFIG, "{}"))
        self.manifest = _json_object(CONNECTOR_MANIFEST, os.environ.get(CONNECTOR_MANIFEST, "{}"))
        module, _, class_name = self.connector_spec.rpartition(":")
        self.connector_name, self.module_path = class_name, module or None
        if self.module_path is not None:
            _find_module(self.module_path)
        super().__init__()
        self._check_connector()
        if self.module_path is None and self.connector_name in SEAMS:
            self.seam = SEAMS[self.connector_name](self)
        sizes = self.capabilities().tensor_parallel_sizes
        if self.seam.in_rank_processes and max(sizes) > 1 and ranks_in_processes():
            self.start_rank_servers(max(sizes))  # here, not in start: each imports vLLM, outside any call's deadline
        # a connector's threads may still write to its storage as the adapter closes: the kit's cleanup never fails it
        self.storage = tempfile.TemporaryDirectory(prefix="kvconform-connector-", ignore_cleanup_errors=True)

    def _check_connector(self) -> None:
        """Refuse a connector vLLM cannot build: unknown name, unimportable module, not a KVConnectorBase_V1."""
        factory = self.rt.factory.KVConnectorFactory
        base = self.rt.connector_base.KVConnectorBase_V1
        try:
            if self.module_path is None:
                if self.connector_name not in factory._registry:
                    raise AdapterNotFound(f"unknown connector {self.connector_name!r}: vLLM {self.rt.version} knows "
                                          f"{', '.join(sorted(factory._registry))}, or give module:Class")
                connector_class = factory._registry[self.connector_name]()
            else:
                connector_class = getattr(self.rt.load(self.module_path), self.connector_name)
        except (ImportError, AttributeError) as error:
            raise AdapterNotFound(f"cannot load connector {self.connector_spec!r}: {error}") from None
        if not (isinstance(connector_class, type) and issubclass(connector_class, base)):
            raise AdapterNotFound(f"{self.connector_spec!r} is not a KVConnectorBase_V1 subclass")

    def capabilities(self) -> Capabilities:
        shared = {key: value for key, value in self.base_capabilities().items() if key in ("preemption", "abort")}
        try:
            return Capabilities(**{**DEFAULT_MANIFEST, **self.seam.capabilities(), **shared, **self.manifest,
                                   "levels": ("connector",), "harness_completes_transfers": self.holds_transfers})
        except ValidationError as error:
            raise AdapterNotFound(f"{CONNECTOR_MANIFEST}: {error.errors()[0]['loc']}: "
                                  f"{error.errors()[0]['msg']}") from None

    @property
    def holds_transfers(self) -> bool:
        """Whether a seam of the kit holds the connector's transfers until the harness completes them; a black box's
        complete on its own clock."""
        return self.module_path is None and self.connector_name in SEAMS

    def extra_config(self, config: EngineConfig) -> dict[str, Any]:
        """The user's extra config over the seam's; ExampleConnector's store directory, if not given, is fresh for each
        engine."""
        directory = tempfile.mkdtemp(dir=self.storage.name)
        return {"shared_storage_path": directory, **self.seam.extra_config(config), **self.connector_config}

    def transfer_config(self) -> dict[str, Any]:
        return {"kv_connector_module_path": self.module_path} if self.module_path else {}

    def observe_metadata(self, meta: Any) -> None:
        """The metadata is the connector's own business at this level."""

    def observe_connector(self, observation: dict[str, Any]) -> None:
        """No offloading-level fields: a black box reports the connector level's only."""

    def store_contents(self) -> Any:
        raise NotImplementedError("vllm-connector reports the connector level only (Capabilities.levels)")

    def pinned_offload_blocks(self) -> int:
        return 0

    def jobs_in_flight(self) -> int:
        """Return the transfers the seam holds for the harness to complete: the connector's own are its business."""
        return len(self.transfers.held)

    def close(self) -> None:
        try:
            self.close_ranks()
        finally:
            self.seam.close()
            self.storage.cleanup()


def _find_module(module: str) -> None:
    """Make `module` importable from the current directory, as `python -m` would, and refuse it before vLLM's slow
    import when it is not there."""
    on_path_from_current_directory()
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a relative name
        found = False
    if not found:
        raise AdapterNotFound(f"cannot load connector module {module!r}: not found on the Python path (the current "
                              f"directory {os.getcwd()} included)")


def _json_object(variable: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise AdapterNotFound(f"{variable} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise AdapterNotFound(f"{variable} must be a JSON object, not {type(value).__name__}")
    return value
