"""Benchmark 3: the reference's block transfers against torch moving the same bytes without the kit.

Blocks are shaped like vLLM's: 16 tokens × (layers × K/V × kv_heads × head_dim) elements, fp16 and
bf16, with jobs of many blocks at random GPU block ids and random store slots. Each job is timed next to
two baselines between the same two devices, in a random order each time, so that a slower or busier
moment, or a cache the previous copy warmed, favours no side:

- **the same blocks** (the target): one `torch._foreach_copy_` over the job's block pairs, torch's batched
  copy with none of the kit's work (pairing checks, finding runs of consecutive blocks); vLLM's own CPU
  swap also copies block by block. The ratio is the share of the time the copy itself takes: it falls
  below 1 only by what the kit adds, wherever it runs.
- **one contiguous copy** (reported, no target): a plain `copy_` of as many bytes in one piece. Random blocks
  are 128 KiB pieces at scattered addresses, which a memory system moves slower than one stream: measured
  on 2-core machines of one kind, 0.76 – 0.87 on one and 0.55 – 0.70 on another for the same code. That part
  of the ratio is the machine's, not the kit's.

What else the ratios depend on, measured on this 2-core machine under load:

- threads: measured with one CPU thread. With torch's default threads on a busy machine a copy waits on
  OpenMP threads that other processes hold, and the ratios swing from 0.02 to 1.9;
- run coalescing: random ids rarely form runs of consecutive blocks. The same jobs with sorted ids reach
  0.69 – 0.85 of one contiguous copy where random ids reach 0.52 – 0.67; real block tables lie in between;
- allocation: every buffer is allocated and written before it is timed. Into untouched memory the same copy
  is 5 – 6 times slower (page faults), which would be measured instead of the copy. Where the buffers land
  still moves the contiguous ratio: three passes in one process, each over freshly allocated buffers, gave
  0.62, 0.78 and 0.62 of one contiguous copy, and 0.86, 0.99 and 0.87 of the same blocks' batched copy.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.reference.transfer import TransferEngine

NAME = "transfer"

DIRECTIONS = ("store", "load")
"""store: GPU blocks → store rows (`copy_to_store`); load: store rows → GPU blocks (`copy_to_gpu`)."""

BASELINES = ("same blocks", "contiguous")


@dataclass(frozen=True)
class TransferSettings:
    block_size: int = 16
    token_width: int = 2 * 2 * 8 * 128
    """2 layers × K and V × 8 KV heads × head_dim 128: 128 KiB per fp16 block."""
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    job_blocks: tuple[int, ...] = (64, 256, 512)
    pool_blocks: int = 1024
    repetitions: int = 20
    cpu_threads: int = 1
    """Intra-op threads for every side of the CPU ratios: one, so that a copy never waits on OpenMP threads
    another process holds."""


@dataclass(frozen=True)
class DevicePair:
    label: str
    device: torch.device | None
    """The engine's GPU side; the store is pinned CPU memory when this is CUDA (reference.transfer)."""


def device_pairs() -> list[DevicePair]:
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    return [DevicePair("cpu ↔ cpu", torch.device("cpu")), DevicePair("cuda ↔ pinned cpu", cuda)]


def measure(settings: TransferSettings, progress: Progress) -> list[Figure]:
    """Return bytes/s of `copy_to_store` and `copy_to_gpu` and their ratio to each baseline, per device pair, dtype."""
    figures = []
    for pair in device_pairs():
        for dtype in settings.dtypes:
            if pair.device is None:
                figures += _unavailable(pair, dtype, "CUDA is not available on this machine")
                continue
            progress(f"{NAME}: {pair.label} {dtype}")
            with _threads(settings.cpu_threads):
                figures += _measure_pair(settings, pair, dtype)
    return figures


def _measure_pair(settings: TransferSettings, pair: DevicePair, dtype: str) -> list[Figure]:
    engine = TransferEngine(settings.pool_blocks, settings.pool_blocks, settings.block_size, 1,
                            settings.token_width, dtype, pair.device)
    gpu_side = _buffer_like(engine.gpu, settings.pool_blocks)
    store_side = _buffer_like(engine.store, settings.pool_blocks)
    plain_ends = {"store": (gpu_side, store_side), "load": (store_side, gpu_side)}
    rng = random.Random(0)
    samples: dict[str, list[dict[str, float]]] = {direction: [] for direction in DIRECTIONS}
    for repetition in range(settings.repetitions + 1):  # the first pass warms up and is not kept
        times = {direction: dict.fromkeys(("engine", *BASELINES), 0.0) for direction in DIRECTIONS}
        for count in settings.job_blocks:
            gpu_blocks = rng.sample(range(1, settings.pool_blocks), count)
            rows = rng.sample(range(settings.pool_blocks), count)
            for direction in DIRECTIONS:
                first, second = (rng.randrange(settings.pool_blocks - count + 1) for _ in range(2))
                jobs = _copies(engine, direction, gpu_blocks, rows, plain_ends[direction], first, second)
                for name in rng.sample(list(jobs), len(jobs)):
                    times[direction][name] += _timed(jobs[name])
        if repetition:
            for direction in DIRECTIONS:
                samples[direction].append(times[direction])
    job_bytes = sum(settings.job_blocks) * engine.gpu[0].numel() * engine.gpu.element_size()
    return [figure for direction in DIRECTIONS
            for figure in _figures(pair, dtype, direction, samples[direction], job_bytes, settings)]


def _copies(engine: TransferEngine, direction: str, gpu_blocks: list[int], rows: list[int],
            plain_ends: tuple[torch.Tensor, torch.Tensor], first: int, second: int) -> dict[str, Callable[[], object]]:
    """Return, to be timed, the engine's copy of one job and the baselines' copies of as many blocks between the plain
    (source, target) buffers: the same blocks, and one contiguous piece (source from block `second`, target from
    block `first`)."""
    source, target = plain_ends
    source_ids, target_ids = (gpu_blocks, rows) if direction == "store" else (rows, gpu_blocks)
    count = len(gpu_blocks)
    return {
        "engine": (lambda: engine.copy_to_store(gpu_blocks, rows)) if direction == "store" else
                  (lambda: engine.copy_to_gpu(rows, gpu_blocks)),
        "same blocks": lambda: torch._foreach_copy_([target[i] for i in target_ids], [source[i] for i in source_ids],
                                                    non_blocking=True),
        "contiguous": lambda: target[first : first + count].copy_(source[second : second + count], non_blocking=True),
    }


def _figures(pair: DevicePair, dtype: str, direction: str, samples: list[dict[str, float]], job_bytes: int,
             settings: TransferSettings) -> list[Figure]:
    label = f"{pair.label} {dtype} {direction}"
    on_cpu = pair.device is not None and pair.device.type == "cpu"
    note = (f"jobs of {'/'.join(map(str, settings.job_blocks))} random blocks, median of {settings.repetitions}"
            + (f", {settings.cpu_threads} CPU thread(s)" if on_cpu else ""))

    def ratio(baseline: str) -> float:
        return statistics.median(sample[baseline] / sample["engine"] for sample in samples)

    return [
        Figure(benchmark=NAME, figure=f"{label} bytes/s",
               value=statistics.median(job_bytes / sample["engine"] for sample in samples), unit="bytes/s", note=note),
        Figure(benchmark=NAME, figure=f"{label} ratio to the same blocks' batched copy", value=ratio("same blocks"),
               unit="ratio", target=at_least(0.7), note="what the kit adds to torch moving the same blocks"),
        Figure(benchmark=NAME, figure=f"{label} ratio to one contiguous copy", value=ratio("contiguous"),
               unit="ratio", note="also the machine's cost of scattered blocks against one stream"),
    ]


def _buffer_like(side: torch.Tensor, blocks: int) -> torch.Tensor:
    """Return a buffer of `blocks` blocks in the same kind of memory as `side` (pinned or not)."""
    return torch.zeros((blocks, *side.shape[1:]), dtype=side.dtype, device=side.device, pin_memory=side.is_pinned())


def _unavailable(pair: DevicePair, dtype: str, reason: str) -> list[Figure]:
    return [Figure(benchmark=NAME, figure=f"{pair.label} {dtype} {direction} ratio to the same blocks' batched copy",
                   value=None, unit="ratio", target=at_least(0.7), note=reason) for direction in DIRECTIONS]


def _timed(work: Callable[[], object]) -> float:
    """Return the seconds `work` takes, all device work included."""
    _synchronize()
    started = time.perf_counter()
    work()
    _synchronize()
    return time.perf_counter() - started


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
