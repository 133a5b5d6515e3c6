"""Benchmark 4: the reference's per-step cost as the GPU pool and the offload store grow.

One fixed workload runs on engines whose GPU pool and store both hold 1k … 100k blocks. The store
starts full, as in a server that has run for a while, so every store evicts. Each round adds
requests over a shared set of documents, prefills and decodes them, stores their blocks, waits for
every transfer, then resets the local prefix cache: the next round finds its documents only in the
store and loads them. The blocks touched are the same at every size, so the per-step cost must be
too (the step follows the blocks touched, not the cache size).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from kvconform.benchmarks.figures import Figure, Progress, at_most
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.reference.engine import Engine

NAME = "scaling"


@dataclass(frozen=True)
class ScalingSettings:
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000)
    policies: tuple[str, ...] = ("lru", "arc")
    rounds: int = 16
    requests_per_round: int = 8
    document_tokens: int = 96
    tail_tokens: int = 20
    max_tokens: int = 16
    repetitions: int = 5


@dataclass(frozen=True)
class WorkloadRun:
    seconds: float
    steps: int
    loads: int
    stores: int

    @property
    def per_step_us(self) -> float:
        return self.seconds / self.steps * 1e6


def engine_config(size: int, policy: str) -> EngineConfig:
    return EngineConfig(block_size=16, num_gpu_blocks=size, block_size_factor=2, num_offload_blocks=size,
                        eviction_policy=policy, max_num_batched_tokens=512, token_width=64, kv_dtype="float16")


def full_engine(size: int, policy: str) -> Engine:
    """Return an engine whose store is full of idle blocks that no workload request shares."""
    engine = Engine(engine_config(size, policy))
    fillers = [b"filler-%09d" % index for index in range(size)]
    engine.manager.prepare_store(fillers)
    engine.manager.complete_store(fillers, success=True)
    return engine


def workload(settings: ScalingSettings) -> list[list[RequestSpec]]:
    """Return the requests of each round: documents shared across rounds, a fresh tail for each request."""
    rng = random.Random(0)
    documents = [[rng.randrange(1000) for _ in range(settings.document_tokens)]
                 for _ in range(settings.requests_per_round)]
    return [[RequestSpec(request_id=f"r{round_}-{index}",
                         prompt=(*documents[(round_ + index) % len(documents)],
                                 *(rng.randrange(1000) for _ in range(settings.tail_tokens))),
                         max_tokens=settings.max_tokens)
             for index in range(settings.requests_per_round)]
            for round_ in range(settings.rounds)]


def run_workload(engine: Engine, rounds: list[list[RequestSpec]]) -> WorkloadRun:
    """Run every round to the end, transfers included, then reset the local prefix cache."""
    steps = loads = stores = 0
    started = time.perf_counter()
    for requests in rounds:
        for request in requests:
            engine.add_request(request)
        while _busy(engine, requests):
            result = engine.step()
            engine.complete_transfers(fail_loads=False, fail_stores=False)
            steps += 1
            loads += len(result.trace.loads)
            stores += len(result.trace.stores)
        if not engine.reset_prefix_cache():
            raise RuntimeError("the scaling workload left GPU blocks in use: the prefix cache cannot be reset")
    return WorkloadRun(time.perf_counter() - started, steps, loads, stores)


def _busy(engine: Engine, requests: list[RequestSpec]) -> bool:
    unfinished = any(not engine.requests[request.request_id].is_finished for request in requests)
    return unfinished or engine.in_flight_job_count() > 0 or bool(engine.delayed_free)


def measure(settings: ScalingSettings, progress: Progress) -> list[Figure]:
    """Return the per-step cost at each size and its ratio between the largest and the smallest size, per policy."""
    return [figure for policy in settings.policies for figure in _measure_policy(settings, policy, progress)]


def _measure_policy(settings: ScalingSettings, policy: str, progress: Progress) -> list[Figure]:
    rounds = workload(settings)
    run_workload(full_engine(min(settings.sizes), policy), rounds)  # warm-up, not kept
    runs: dict[int, list[WorkloadRun]] = {size: [] for size in settings.sizes}
    for repetition in range(settings.repetitions):
        for size in settings.sizes:  # sizes interleaved, so a busier moment does not fall on one size only
            progress(f"{NAME}: {policy}, {size:,} blocks, repetition {repetition + 1}/{settings.repetitions}")
            runs[size].append(run_workload(full_engine(size, policy), rounds))
    shapes = {(run.steps, run.loads, run.stores) for each in runs.values() for run in each}
    if len(shapes) != 1:
        raise RuntimeError(f"the scaling workload did different work at different sizes: {shapes}")
    steps, loads, stores = shapes.pop()
    cost = {size: statistics.median(run.per_step_us for run in each) for size, each in runs.items()}
    smallest, largest = min(settings.sizes), max(settings.sizes)
    figures = [Figure(benchmark=NAME, figure=f"{policy}: per-step cost, {size:,} blocks", value=cost[size],
                      unit="µs/step", note=f"median of {settings.repetitions}" if size == smallest else "")
               for size in settings.sizes]
    figures.append(Figure(benchmark=NAME, figure=f"{policy}: per-step cost {largest:,} / {smallest:,} blocks",
                          value=cost[largest] / cost[smallest], unit="ratio", target=at_most(1.5),
                          note=f"{steps} steps, {loads} loads, {stores} stores per workload"))
    return figures
