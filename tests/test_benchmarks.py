"""`kvconform bench`: every benchmark runs in a tiny configuration and reports well-formed figures.

No timing is asserted here: the figures' targets are the benchmarks' business, not the tests'.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from faulty_adapters import faulty, raising
from kvconform.benchmarks import (
    connectors,
    counterexample,
    engine,
    scaling,
    suite,
    throughput,
    traces,
    transfer,
    vendor,
    workers,
)
from kvconform.cli import main
from kvconform.conformance.mutants import MUTANTS, Mutant
from kvconform.conformance.profiles import PROFILES, Profile

TINY = dict(
    throughput=throughput.ThroughputSettings(profile="bench-test"),
    counterexample=counterexample.CounterexampleSettings(profile="bench-test"),
    transfer=transfer.TransferSettings(token_width=64, job_blocks=(4, 8), pool_blocks=32, repetitions=2),
    scaling=scaling.ScalingSettings(sizes=(40, 120), rounds=2, requests_per_round=2, document_tokens=32,
                                    tail_tokens=4, max_tokens=2, repetitions=1),
    workers=workers.WorkersSettings(workers=(1,), profile="smoke", catalogue_profile="smoke",
                                    mutants=("skip-flag-ignored",)),
    vendor=vendor.VendorSettings(connector="tests.no_such_connector:Nope", scenarios=("tenant-isolation",)),
    connectors=connectors.ConnectorsSettings(profile="bench-test", connectors=("ExampleConnector",)),
    traces=traces.TracesSettings(profile="bench-test", repetitions=1),
    engine=engine.EngineSettings(repetitions=1),
)
"""The vendor benchmark's commands are refused before vLLM's import (an unknown module): four processes, no run. The
connectors benchmark runs ExampleConnector where vLLM is installed, and says why not where it is not."""

COUNTS = {"requests", "fraction"}
"""Units whose figures may be 0: a counterexample may need no request, a share may be nothing."""


@pytest.fixture
def tiny_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink every benchmark, and add a mutant that fails at its first step, which 10 examples draw at any seed."""
    monkeypatch.setitem(PROFILES, "bench-test", Profile(max_examples=10, stateful_step_count=8, shrink_attempts=50,
                                                        derandomize=True))
    monkeypatch.setitem(MUTANTS, "step-raises", Mutant(faulty("step", raising, after=0), "test", ("CONF-CALL-1",)))
    monkeypatch.setattr(suite, "Settings", functools.partial(suite.Settings, **TINY))


def test_bench_writes_every_figure(tiny_bench: None, tmp_path: Path) -> None:
    """Each benchmark reports figures; each is a finite number, positive unless a count, or absent with the reason."""
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--json", str(path), "--seeds", "1", "--mutants", "step-raises"])
    assert result.exit_code == 0, result.output + result.stderr
    assert "met?" in result.stdout
    written = json.loads(path.read_text())
    assert written["benchmarks"] == list(suite.BENCHMARKS)
    assert {"cores", "torch", "torch_threads", "device"} <= written["machine"].keys()
    datetime.datetime.fromisoformat(written["date"])
    figures = written["figures"]
    assert {figure["benchmark"] for figure in figures} == set(suite.BENCHMARKS)
    for figure in figures:
        if figure["value"] is None:
            assert figure["note"], figure
            continue
        assert math.isfinite(figure["value"]) and figure["value"] >= 0, figure
        assert figure["value"] > 0 or figure["unit"] in COUNTS, figure
        if figure["target"] is not None:
            target = figure["target"]
            expected = figure["value"] >= target["bound"] if target["at_least"] else figure["value"] <= target["bound"]
            assert figure["met"] is expected, figure


def test_unmeasured_figures_are_cuda_only(tiny_bench: None) -> None:
    """Only the CUDA transfer figures may be missing, and only without CUDA; a failing mutant yields every figure."""
    settings = suite.Settings(counterexample=counterexample.CounterexampleSettings(
        profile="bench-test", seeds=1, mutants=("step-raises",)))
    report = suite.run(["counterexample", "transfer"], settings, progress=lambda line: None)
    missing = [figure.figure for figure in report.figures if figure.value is None]
    if torch.cuda.is_available():
        assert missing == []
    else:
        assert missing and all(name.startswith("cuda") for name in missing)
    clause_rate = next(figure for figure in report.figures if figure.figure == "step-raises: seeds failing CONF-CALL-1")
    assert clause_rate.value == 1.0 and clause_rate.met


@pytest.mark.parametrize("args, message", [
    (["--only", "transfer,nope"], "unknown benchmark nope"),
    (["--mutants", "no-such-mutant"], "unknown mutant no-such-mutant"),
    (["--seeds", "0"], "--seeds"),
])
def test_bad_selection_is_exit_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr
