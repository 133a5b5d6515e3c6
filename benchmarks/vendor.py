"""Benchmark 6: a vendor's verdict time (issue 22 item 7) — the wall time of the commands a vendor runs on a connector,
vLLM's import included: the own-clock double's `ci` verdict, one scenario, and N scenarios in one `kvconform replay`
against N invocations. Each command is a fresh process, as the vendor's shell starts it; no target is set (the
figures are the machine's as much as the kit's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvconform.adapters.vllm import runtime
from kvconform.benchmarks.figures import Figure, Progress

NAME = "vendor"
ROOT = Path(__file__).resolve().parents[1]
"""The checkout: the double is `tests.own_clock_connector`, found from the current directory as a vendor's is."""


@dataclass(frozen=True)
class VendorSettings:
    connector: str = "tests.own_clock_connector:OwnClockConnector"
    profile: str = "ci"
    scenarios: tuple[str, ...] = ("skip-read-black-box-sync", "skip-read-black-box-async", "tenant-isolation")
    timeout: float = 900.0
    """Seconds one command may take before it is reported not measured."""


def _timed(progress: Progress, settings: VendorSettings, *arguments: str) -> tuple[float | None, str]:
    """Return the wall seconds of `kvconform ARGUMENTS` and its exit status, or None and why it was not measured."""
    command = [str(Path(sys.executable).with_name("kvconform")), *arguments, "--adapter", "vllm-connector",
               "--connector", settings.connector]
    progress(f"{NAME}: {' '.join(command[1:])}")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=settings.timeout,
                              env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        return None, f"not measured: over {settings.timeout:g} s"
    seconds = time.perf_counter() - started
    last = ((done.stdout + done.stderr).strip().splitlines() or [""])[-1][:120]
    return seconds, f"exit {done.returncode}" + (f": {last}" if done.returncode else "")


def measure(settings: VendorSettings, progress: Progress) -> list[Figure]:
    """Return the wall seconds of the double's verdict, of one scenario, and of N scenarios in one process and in N."""
    if runtime.installed_version() is None or not (ROOT / "tests" / "own_clock_connector.py").exists():
        why = "not measured: needs vLLM (kvconform install-vllm) and the kit's checkout (tests/own_clock_connector.py)"
        return [Figure(benchmark=NAME, figure=figure, value=None, unit="s", note=why)
                for figure in ("ci verdict", "one scenario", "N scenarios, one replay", "N scenarios, N replays")]
    load = os.getloadavg()[0]
    version = f"vLLM {runtime.installed_version()}, load average {load:.2f}"
    verdict, verdict_note = _timed(progress, settings, "run", "--profile", settings.profile)
    one, one_note = _timed(progress, settings, "replay", settings.scenarios[0])
    together, together_note = _timed(progress, settings, "replay", *settings.scenarios)
    apart = [_timed(progress, settings, "replay", scenario) for scenario in settings.scenarios]
    apart_seconds = None if any(seconds is None for seconds, _ in apart) else sum(s or 0.0 for s, _ in apart)
    count = len(settings.scenarios)
    return [
        Figure(benchmark=NAME, figure="ci verdict", value=verdict, unit="s",
               note=f"kvconform run --profile {settings.profile}, the own-clock double, {version}; {verdict_note}"),
        Figure(benchmark=NAME, figure="one scenario", value=one, unit="s",
               note=f"kvconform replay {settings.scenarios[0]}; {one_note}"),
        Figure(benchmark=NAME, figure="N scenarios, one replay", value=together, unit="s",
               note=f"N = {count} in one kvconform replay (vLLM imported once); {together_note}"),
        Figure(benchmark=NAME, figure="N scenarios, N replays", value=apart_seconds, unit="s",
               note=f"the same {count}, one kvconform replay each; "
                    + "; ".join(note for _, note in apart)),
    ]
