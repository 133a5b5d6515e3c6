"""Traces (issue 38 items 2-4): a run recorded with --record-trace and judged again by `kvconform check` reaches the
live verdict, for the reference and every mutant of the catalogue; the checker judges the records, not a stored
verdict; a trace it cannot use is one line and exit 2, never a traceback or a pass."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvconform.cli import main
from kvconform.common import trace
from kvconform.conformance import runner
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.mutants import MUTANTS
from kvconform.conformance.playback import Trace
from kvconform.conformance.recording import Recorder

TIMINGS = ("seconds", "found_after", "adapter_seconds", "reference_seconds", "checks_seconds", "execution_seconds")
"""Report fields that measure time: a check takes its own."""


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def report_without_timings(path: Path) -> dict:
    report = json.loads(path.read_text())
    for name in TIMINGS:
        report.pop(name, None)
        report["statistics"].pop(name, None)
    return report


def recorded_run(adapter: type, name: str, path: Path, profile: str = "smoke") -> runner.RunResult:
    """Run `adapter` under `profile`, recording the trace at `path`, as `kvconform run --record-trace` does."""
    header = {"adapter": name, "implementation": "test", "behaviours": [], "capabilities": {}, "profile": profile,
              "seed": None, "scheduling": "both", "drain_timeout": 10.0, "tensor_parallel_size": None,
              "known_failures": [], "known_failures_files": []}  # trace.RUN_FIELDS
    return runner.run(adapter, name, profile, recorder=Recorder(path, header))


def recorded_from_the_command_line(folder: Path) -> Path:
    """Return the trace `kvconform run --record-trace` writes of the seed-bug mutant's failing smoke run."""
    path = folder / "run.jsonl"
    code, _, stderr = cli("run", "--adapter", "kvconform_test_mutant:make", "--profile", "smoke", "--database", "none",
                          "--record-trace", str(path))
    assert code == 1, stderr
    return path


def verdict(result: runner.RunResult) -> tuple:
    """What a run concluded: the failure and its counterexample, what it exercised and drew, what it counted."""
    return (result.passed, result.failed_clause, result.message, result.program, result.counterexample,
            result.coverage, result.exercise, result.findings, result.statistics.examples, result.statistics.rules,
            result.statistics.steps)


def test_a_recorded_run_checks_to_the_live_report(tmp_path: Path) -> None:
    """`kvconform check` of the trace of `kvconform run --record-trace` writes the live run's report, timings aside,
    and exits as it did."""
    path = tmp_path / "run.jsonl"
    live_code, _, stderr = cli("run", "--profile", "smoke", "--record-trace", str(path), "--report",
                               str(tmp_path / "live.json"), "--junit", str(tmp_path / "live.xml"))
    assert f"kvconform check {path}" in stderr
    code, stdout, _ = cli("check", str(path), "--report", str(tmp_path / "checked.json"), "--junit",
                          str(tmp_path / "checked.xml"))
    assert (code, live_code) == (0, 0), stdout
    assert report_without_timings(tmp_path / "checked.json") == report_without_timings(tmp_path / "live.json")
    assert (tmp_path / "checked.xml").read_text().count("<testcase") == \
        (tmp_path / "live.xml").read_text().count("<testcase")


def test_every_line_is_one_record_of_the_format(tmp_path: Path) -> None:
    """The trace opens with its header, ends with its end record, and each call is followed by its one outcome."""
    path = tmp_path / "run.jsonl"
    recorded_run(MUTANTS["skip-flag-ignored"].adapter, "skip-flag-ignored", path)
    kinds = [record["record"] for _, record in trace.read(path)]
    assert kinds[0] == "trace" and kinds[-1] == "end" and kinds.count("trace") == kinds.count("end") == 1
    outcomes = [kinds[i + 1] for i, kind in enumerate(kinds) if kind == "call"]
    assert set(outcomes) <= {"return", "raise", "hang"} and len(outcomes) == kinds.count("call")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if MUTANTS[name].levels == ("connector",) else
                                               [pytest.mark.long]) for name in sorted(MUTANTS)])
def test_a_mutants_recorded_run_fails_offline_as_it_failed_live(name: str, tmp_path: Path) -> None:
    """Judged again from its trace, a mutant's run reaches the live verdict: the same clause, message and shrunk
    counterexample, and the same coverage and situations drawn (item 4: every catalogue row, each level)."""
    path = tmp_path / f"{name}.jsonl"
    live = recorded_run(MUTANTS[name].adapter, name, path)
    assert verdict(runner.check(Trace.read(path), Baseline())) == verdict(live)


def tampered(path: Path, operation: str, change) -> Path:
    """Return a copy of the trace at `path` whose first answer to `operation` that `change` alters is altered."""
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines[:-1]):
        record = json.loads(line)
        if record["record"] == "call" and record["operation"] == operation:
            answer = json.loads(lines[index + 1])
            altered = change(answer["value"])
            if altered is not None:
                lines[index + 1] = json.dumps({**answer, "value": altered})
                break
    copy = path.with_name(f"tampered-{path.name}")
    copy.write_text("\n".join(lines) + "\n")
    return copy


def test_the_checker_judges_the_recorded_answers(tmp_path: Path) -> None:
    """A trace of a conformant run whose recorded KV bytes are altered no longer checks conformant: the checker judges
    the answers, it does not read back a verdict."""
    path = tmp_path / "run.jsonl"
    assert cli("run", "--profile", "smoke", "--record-trace", str(path))[0] == 0

    def other_bytes(value: dict) -> dict | None:
        kv = value["$tensor"]
        data = bytearray(base64.b64decode(kv["data"]))
        if not data:
            return None
        data[-1] ^= 0x40  # a sign or high exponent bit of the last element
        return {"$tensor": {**kv, "data": base64.b64encode(bytes(data)).decode("ascii")}}

    code, stdout, _ = cli("check", str(tampered(path, "computed_kv", other_bytes)))
    assert code == 1
    assert "XFER-DATA-1" in stdout or "KVC-DATA-1" in stdout, stdout


def test_an_unreadable_recorded_value_is_the_traces_fault_not_the_adapters(tmp_path: Path) -> None:
    """A recorded answer that does not decode (its bytes cut) is one line and exit 2, naming the record; it is not
    judged as the adapter's raise (CONF-CALL-1)."""
    path = tmp_path / "run.jsonl"
    assert cli("run", "--profile", "smoke", "--record-trace", str(path))[0] == 0
    cut = tampered(path, "computed_kv", lambda value: {"$tensor": {**value["$tensor"], "data": "A"}})
    code, _, stderr = cli("check", str(cut))
    assert code == 2 and "an unreadable value" in stderr and "CONF-CALL-1" not in stderr, stderr


@pytest.mark.parametrize(("edit", "message"), [
    (lambda lines: lines[:5] + [lines[5][: len(lines[5]) // 2]] + lines[6:], ":6: not a JSON record"),
    (lambda lines: [lines[0].replace('"version":1', '"version":9')] + lines[1:], ":1: trace format version 9"),
    (lambda lines: [lines[0].replace('"scheduling":', '"scheduled":')] + lines[1:],
     ":1: the trace header's run lacks scheduling"),
    (lambda lines: lines[1:], ":1: not a kvconform-trace file"),
    (lambda lines: lines[:3] + ['{"record": "gossip"}'] + lines[3:], ":4: not a trace record"),
    (lambda lines: lines[:3] + ['{"record": "call", "operation": "step"}'] + lines[3:],
     ":4: a call record without args"),
    (lambda lines: lines[:4] + [lines[5], lines[4]] + lines[6:], ":5: the checker's run"),
    (lambda lines: lines[:-1], "has no end record"),
    (lambda lines: lines + lines[:1], "a second trace header"),
    (lambda lines: [], "an empty file"),
])
def test_a_trace_the_checker_cannot_use_is_one_line_and_exit_2(tmp_path: Path, edit, message: str) -> None:
    """Corrupt, cut, of another version, out of order, or joined: one clear line naming the record, exit 2."""
    path = recorded_from_the_command_line(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("".join(f"{line}\n" for line in edit(lines)))
    code, _, stderr = cli("check", str(path))
    assert code == 2, stderr
    assert message in stderr and stderr.strip().count("\n") == 0 and "Traceback" not in stderr, stderr


def test_a_trace_that_ends_inside_a_call_is_unknown(tmp_path: Path) -> None:
    """The recording stopped during a call (the process died): that call's outcome is unknown (CONF-CALL-2), never
    a pass."""
    path = recorded_from_the_command_line(tmp_path)
    lines = path.read_text().splitlines()
    last_call = max(index for index, line in enumerate(lines) if json.loads(line)["record"] == "call")
    path.write_text("".join(f"{line}\n" for line in lines[: last_call + 1]))
    code, _, _ = cli("check", str(path), "--report", str(tmp_path / "report.json"))
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and report["outcome"] == "info" and report["failed_clause"] == "CONF-CALL-2"
    assert "has no recorded outcome" in report["message"]


def test_parts_of_a_run_are_reported_as_one(tmp_path: Path) -> None:
    """Several traces of one adapter are checked as the parts of one run: one report, every part's examples."""
    paths = [tmp_path / f"part-{seed}.jsonl" for seed in (1, 2)]
    for seed, path in zip((1, 2), paths, strict=True):
        assert cli("run", "--profile", "smoke", "--seed", str(seed), "--record-trace", str(path))[0] == 0
    code, _, _ = cli("check", *map(str, paths), "--report", str(tmp_path / "report.json"))
    parts = [len([1 for _, record in trace.read(path) if record["record"] == "example" and not record["replay"]])
             for path in paths]
    assert code == 0 and json.loads((tmp_path / "report.json").read_text())["statistics"]["examples"] == sum(parts)


@pytest.mark.long
def test_a_run_split_across_workers_writes_a_trace_per_part(tmp_path: Path) -> None:
    """`--workers 2 --record-trace` writes each part's trace; checked together they give the merged report's verdict
    and coverage."""
    path = tmp_path / "run.jsonl"
    code, _, stderr = cli("run", "--workers", "2", "--profile", "smoke", "--record-trace", str(path), "--report",
                          str(tmp_path / "live.json"))
    parts = [tmp_path / f"run.part-{index}-of-2.jsonl" for index in (1, 2)]
    assert code == 0 and all(part.exists() for part in parts), stderr
    assert cli("check", *map(str, parts), "--report", str(tmp_path / "checked.json"))[0] == 0
    live, checked = (report_without_timings(tmp_path / name) for name in ("live.json", "checked.json"))
    assert (checked["clauses"], checked["exercise"], checked["statistics"]["steps"]) == (
        live["clauses"], live["exercise"], live["statistics"]["steps"])


def test_check_imports_no_adapter(tmp_path: Path) -> None:
    """A trace is checked where its adapter cannot be imported: the checker needs the trace alone."""
    path = recorded_from_the_command_line(tmp_path)
    blocked = ("import sys; sys.modules['kvconform_test_mutant'] = None; sys.modules['vllm'] = None; "
               "from kvconform.cli import main; main()")
    checked = subprocess.run([sys.executable, "-c", blocked, "check", str(path)], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
    assert checked.returncode == 1 and "OFF-READ-1" in checked.stdout, checked.stderr


def check_without_vllm(path: Path, report: Path) -> subprocess.CompletedProcess:
    """Run `kvconform check` on `path` in a process where vLLM cannot be imported."""
    blocked = "import sys; sys.modules['vllm'] = None; from kvconform.cli import main; main()"
    return subprocess.run([sys.executable, "-c", blocked, "check", str(path), "--report", str(report)],
                          capture_output=True, text=True, timeout=900)


@pytest.mark.vllm
@pytest.mark.long
@pytest.mark.parametrize("arguments", [
    ["--adapter", "vllm-offloading"],
    ["--adapter", "vllm-connector", "--connector", "ExampleConnector"],
    ["--adapter", "vllm-connector", "--connector", "OffloadingConnector"],
    ["--adapter", "vllm-connector", "--connector", "tests.own_clock_connector:OwnClockConnector"],
    ["--adapter", "vllm-connector", "--connector", "tests.own_clock_connector:ReportsLoadTwice"],
], ids=["vllm-offloading", "ExampleConnector", "OffloadingConnector", "own-clock", "own-clock-reports-load-twice"])
def test_a_real_connectors_recorded_run_checks_to_its_live_report_without_vllm(
        connector_environment: None, arguments: list[str], tmp_path: Path) -> None:
    """A real vLLM connector's run — at every tensor-parallel size drawn, ranks in their own processes, and on its own
    clock (the double, and its twin that reports a load twice) — recorded and checked where vLLM cannot even be
    imported, reaches the live report (item 4, the real connectors)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: kvconform install-vllm 0.24.0")
    path = tmp_path / "run.jsonl"
    live = CliRunner().invoke(main, ["run", *arguments, "--profile", "smoke", "--database", "none",
                                     "--record-trace", str(path), "--report", str(tmp_path / "live.json")])
    checked = check_without_vllm(path, tmp_path / "checked.json")
    assert checked.returncode == live.exit_code, checked.stderr
    assert report_without_timings(tmp_path / "checked.json") == report_without_timings(tmp_path / "live.json")
