"""Benchmark 3: the reference's block transfers against one plain contiguous copy of the same bytes.

Blocks are shaped like vLLM's: 16 tokens × (layers × K/V × kv_heads × head_dim) elements, fp16 and
bf16, with jobs of many blocks at random GPU block ids and random store slots. Each job is timed
next to a plain `copy_` of as many bytes between the same two devices, so a slower or busier moment
affects both sides of the ratio alike.
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
    """Intra-op threads for both sides of the CPU ratio: one, so it compares a memcpy with a memcpy
    rather than OpenMP fork-and-join on a shared machine."""


@dataclass(frozen=True)
class DevicePair:
    label: str
    device: torch.device | None
    """The engine's GPU side; the store is pinned CPU memory when this is CUDA (reference.transfer)."""


def device_pairs() -> list[DevicePair]:
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    return [DevicePair("cpu ↔ cpu", torch.device("cpu")), DevicePair("cuda ↔ pinned cpu", cuda)]


def measure(settings: TransferSettings, progress: Progress) -> list[Figure]:
    """Return bytes/s of `copy_to_store` and `copy_to_gpu` and their ratio to a plain copy, per device pair, dtype."""
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
    samples = {direction: [] for direction in DIRECTIONS}
    for repetition in range(settings.repetitions + 1):  # the first pass warms up and is not kept
        times = {direction: [0.0, 0.0] for direction in DIRECTIONS}
        for count in settings.job_blocks:
            gpu_blocks = rng.sample(range(1, settings.pool_blocks), count)
            rows = rng.sample(range(settings.pool_blocks), count)
            jobs = {"store": lambda: engine.copy_to_store(gpu_blocks, rows),
                    "load": lambda: engine.copy_to_gpu(rows, gpu_blocks)}
            for direction in DIRECTIONS:
                source, target = (_random_run(end, count, rng) for end in plain_ends[direction])
                times[direction][0] += _timed(lambda: target.copy_(source))
                times[direction][1] += _timed(jobs[direction])
        if repetition:
            for direction, (plain_seconds, engine_seconds) in times.items():
                samples[direction].append((plain_seconds, engine_seconds))
    job_bytes = sum(settings.job_blocks) * engine.gpu[0].numel() * engine.gpu.element_size()
    return [figure for direction in DIRECTIONS
            for figure in _figures(pair, dtype, direction, samples[direction], job_bytes, settings)]


def _figures(pair: DevicePair, dtype: str, direction: str, samples: list[tuple[float, float]], job_bytes: int,
             settings: TransferSettings) -> list[Figure]:
    label = f"{pair.label} {dtype} {direction}"
    note = (f"jobs of {'/'.join(map(str, settings.job_blocks))} blocks, median of {settings.repetitions}"
            + (f", {settings.cpu_threads} CPU thread(s)" if pair.device.type == "cpu" else ""))
    return [
        Figure(benchmark=NAME, figure=f"{label} bytes/s",
               value=statistics.median(job_bytes / engine for _, engine in samples), unit="bytes/s", note=note),
        Figure(benchmark=NAME, figure=f"{label} ratio to copy_",
               value=statistics.median(plain / engine for plain, engine in samples), unit="ratio",
               target=at_least(0.7)),
    ]


def _buffer_like(side: torch.Tensor, blocks: int) -> torch.Tensor:
    """Return a buffer of `blocks` blocks in the same kind of memory as `side` (pinned or not)."""
    return torch.zeros((blocks, *side.shape[1:]), dtype=side.dtype, device=side.device, pin_memory=side.is_pinned())


def _random_run(side: torch.Tensor, blocks: int, rng: random.Random) -> torch.Tensor:
    """Return `blocks` consecutive blocks of `side` at a random place, as cold in the cache as the engine's."""
    first = rng.randrange(len(side) - blocks + 1)
    return side[first : first + blocks]


def _unavailable(pair: DevicePair, dtype: str, reason: str) -> list[Figure]:
    return [Figure(benchmark=NAME, figure=f"{pair.label} {dtype} {direction} ratio to copy_", value=None,
                   unit="ratio", target=at_least(0.7), note=reason) for direction in DIRECTIONS]


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
