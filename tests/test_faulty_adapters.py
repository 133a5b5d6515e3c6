"""The kit never crashes, hangs or passes on a faulty adapter, and bad input to it is one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings

from faulty_adapters import FAULTS
from kvconform.cli import main
from kvconform.common.values import EngineConfig, ResourceUsage, StepObservation, StoreSnapshot
from kvconform.conformance import report, runner
from kvconform.conformance.calls import RETURNS, AdapterCaller
from kvconform.conformance.judging.judge import ClauseViolation

TESTS = Path(__file__).parent
HANG_TIMEOUT = 2.0
"""Seconds before a call counts as hung: short for the hanging adapters, long for a loaded machine's honest ones."""


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_is_a_named_clause_failure(name: str) -> None:
    """CONF-CALL-1, CONF-CALL-2, CONF-OBS-1/2: each fault class fails with its clause, naming the call."""
    factory, clause, text = FAULTS[name]
    result = runner.run(factory, name, "ci", call_timeout=HANG_TIMEOUT)
    assert (result.passed, result.failed_clause) == (False, clause), f"{name}: {result.failed_clause}: {result.message}"
    assert text in result.message, f"{name}: {text!r} not in {result.message!r}"
    assert result.outcome == ("info" if clause == "CONF-CALL-2" else "fail")
    if clause == "CONF-CALL-1":
        assert "faulty_adapters.py" in result.adapter_traceback, "the adapter's own traceback is reported"
    assert result.counterexample, "every failure comes with the calls that led to it"


GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
)


@st.composite
def constructed_models(draw: st.DrawFn, model: type) -> object:
    """A model built with `model_construct` (no validation) from any subset of its fields, each set to garbage."""
    fields = draw(st.lists(st.sampled_from(sorted(model.model_fields)), unique=True))
    return model.model_construct(**{name: draw(GARBAGE, label=name) for name in fields})


@settings(max_examples=300, deadline=None)
@given(operation=st.sampled_from(sorted(RETURNS)), data=st.data())
def test_any_returned_value_is_validated(operation: str, data: st.DataObject) -> None:
    """CONF-OBS-1: whatever an adapter returns is either a valid contract value or a CONF-OBS-1 failure."""
    expected = RETURNS[operation]
    candidates = [GARBAGE]
    if expected in (StepObservation, StoreSnapshot, ResourceUsage):
        candidates.append(constructed_models(expected))
    if expected is torch.Tensor:
        candidates.append(st.builds(torch.zeros, st.integers(0, 3), st.integers(0, 9)))
    value = data.draw(st.one_of(candidates), label="returned")
    caller = AdapterCaller(timeout=None)
    caller.config = EngineConfig()
    try:
        checked = caller.validated(f"adapter.{operation}()", operation, value)
    except ClauseViolation as violation:
        assert violation.clause == "CONF-OBS-1", violation
    else:
        assert isinstance(checked, expected)


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", *args])
    return result.exit_code, result.stderr


@pytest.mark.parametrize("args, message", [
    (["--adapter", "no-such-adapter"], "unknown adapter 'no-such-adapter'"),
    (["--adapter", "no_such_module:make"], "cannot import 'no_such_module'"),
    (["--adapter", "faulty_adapters:no_such_factory"], "has no attribute 'no_such_factory'"),
    (["--adapter", "faulty_adapters:FAULTS"], "which is not callable"),
    (["--adapter", "os:getcwd"], "built str, not a KVConnectorAdapter"),
    (["--adapter", "faulty_adapters:factory_raising"], "RuntimeError: cannot connect to the store"),
    (["--adapter", "faulty_adapters:inconsistent_manifest"], "at least one eviction policy"),
    (["--profile", "nightly-ish"], "unknown profile 'nightly-ish'"),
    (["--adapter", "faulty_adapters:SyncOnlyAdapter", "--scheduling", "async"], "does not support async scheduling"),
    (["--call-timeout", "-1"], "-1"),
    (["--report", "/dev/null/report.json"], "cannot write the report"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    """Bad input to the kit itself: one clear line on stderr, exit code 2, no traceback."""
    code, stderr = cli(*args)
    assert code == 2, (code, stderr)
    assert message in stderr and "Traceback" not in stderr, stderr


def test_an_adapter_module_in_the_current_directory_is_found(tmp_path: Path) -> None:
    """`--adapter module:factory` finds the module in the current directory, as `python -m` would: a vendor's adapter
    file next to where the vendor runs `kvconform run`."""
    (tmp_path / "vendor_adapter_here.py").write_text(
        "from kvconform.adapters.reference import ReferenceAdapter\n\ndef make():\n    return ReferenceAdapter()\n")
    script = Path(sys.executable).with_name("kvconform")  # the console script: unlike `python -m`, no "" on the path
    completed = subprocess.run([str(script), "run", "--adapter", "vendor_adapter_here:make",
                                "--profile", "smoke", "--scheduling", "sync", "--database", "none"],
                               capture_output=True, text=True, timeout=300, cwd=tmp_path,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert completed.returncode == 0 and "conformant" in completed.stdout, completed.stdout + completed.stderr


def test_hung_adapter_still_ends_with_a_report(tmp_path: Path) -> None:
    """CONF-CALL-2: a hung call ends the run as an unknown outcome and the report is still written."""
    path = tmp_path / "report.json"
    code, _ = cli("--adapter", "faulty_adapters:hangs_in_step", "--call-timeout", str(HANG_TIMEOUT),
                  "--report", str(path))
    written = json.loads(path.read_text())
    assert (code, written["outcome"], written["failed_clause"]) == (1, "info", "CONF-CALL-2")
    assert "adapter.step()" in written["counterexample"]


def test_interrupted_run_leaves_the_old_report_intact(tmp_path: Path) -> None:
    """Ctrl-C mid-run: exit 130, one line, and the report file keeps its previous complete content."""
    path = tmp_path / "report.json"
    path.write_text('{"previous": true}')
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "kvconform.cli", "run", "--adapter",
                                "faulty_adapters:SlowAdapter", "--report", str(path)],
                               env=env, stderr=subprocess.PIPE, text=True,
                               # as a terminal would: Ctrl-C not ignored, whatever an earlier test's vLLM set here
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    banner = process.stderr.readline()  # the run has started: imports and the adapter's build are done
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    stderr = banner + stderr
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert json.loads(path.read_text()) == {"previous": True}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"], "no temporary file is left behind"


def test_failed_write_keeps_the_old_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way leaves the old report and no temporary file."""
    path = tmp_path / "report.json"
    path.write_text("old")

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        report.write_atomically(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
