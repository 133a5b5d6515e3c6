"""The options of one conformance run, checked before it starts; shared by the CLI and the pytest plugin.

A mistake in them is the user's, reported as one line (`UsageProblem`): the CLI exits 2, the plugin
raises `pytest.UsageError`. Everything that can be checked is checked before the run — the adapter is
built and asked for its capabilities, report paths must be writable — so a long run never ends unable
to write its report.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard, get_args

from hypothesis.database import ExampleDatabase

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.adapters.registry import AdapterNotFound, available, resolve
from kvconform.common.trace import TraceError
from kvconform.common.values import Capabilities
from kvconform.common.version import KIT_VERSION
from kvconform.conformance import baseline, examples, report, runner
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterCaller, AdapterHung
from kvconform.conformance.execution import DEFAULT_DRAIN_TIMEOUT
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.machine import Scheduling
from kvconform.conformance.playback import Trace, TraceMismatch
from kvconform.conformance.profiles import DEFAULT_PROFILE, PROFILES, Shard
from kvconform.conformance.recording import Recorder
from kvconform.spec import registry

SCHEDULINGS: tuple[str, ...] = get_args(Scheduling)


class UsageProblem(Exception):
    """A mistake in the options of a run; the message is one line that says what is wrong."""


@dataclass(frozen=True)
class RunOptions:
    """A run as asked for, with its adapter already probed."""

    adapter_spec: str
    factory: Callable[[], KVConnectorAdapter]
    capabilities: Capabilities
    implementation_version: str
    profile: str = DEFAULT_PROFILE
    seed: int | None = None
    scheduling: Scheduling = "both"
    call_timeout: float = DEFAULT_CALL_TIMEOUT
    known_entries: tuple[baseline.Entry, ...] = ()
    """The known failures listed for the run, from known_failures_files in order (CONF-RUN-2)."""
    known_failures_files: tuple[str, ...] = ()
    """The files they come from: the implementation's own shipped file, then the user's."""
    unverified: str | None = None
    """Why the implementation's release has no verdict table, when its adapter package ships them for others."""
    behaviours: tuple[str, ...] = ()
    """What the adapter found its implementation to do where releases differ (`KVConnectorAdapter.behaviours`)."""
    report_path: Path | None = None
    junit_path: Path | None = None
    certify: bool = False
    database: ExampleDatabase | None = None
    """Where failing examples are kept and replayed from (CONF-RUN-5); None for none."""
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds a drain waits for a connector on its own clock to go idle (KVC-ASYNC-1, KVC-LIVE-1, KVC-LEAK-1)."""
    tensor_parallel_size: int | None = None
    """Ranks per engine of a pair's run (`--tensor-parallel-size`); None: the state machine draws it (PD-TP-1)."""
    record_trace: Path | None = None
    """Where the run writes its trace (`--record-trace`), for `kvconform check`; None for none."""

    @property
    def rare_known_failures(self) -> frozenset[str]:
        """The names of the entries marked rare: never stale (CONF-RUN-2)."""
        return frozenset(entry.name for entry in self.known_entries if entry.rare)

    @property
    def known_failures(self) -> dict[str, str]:
        """clause -> reason, of every listed clause."""
        return baseline.Baseline(list(self.known_entries)).entries

    def banner(self) -> list[str]:
        """Return the lines a run starts with: the implementation, the behaviours detected in it and the known failures
        it uses; a warning for a release without any."""
        names = ", ".join(behaviour.partition(":")[0] for behaviour in self.behaviours) or "none"
        lines = [f"{self.implementation_version}: behaviours detected: {names}; "
                 f"known failures: {', '.join(self.known_failures_files) or 'none listed'}"]
        return lines + ([f"warning: {self.unverified}"] if self.unverified else [])

    def trace_header(self) -> dict[str, object]:
        """Return what a trace of this run records of it: all `check` needs to judge it again and report alike."""
        return {"adapter": self.adapter_spec, "implementation": self.implementation_version,
                "behaviours": list(self.behaviours), "capabilities": self.capabilities.model_dump(mode="json"),
                "profile": self.profile, "seed": self.seed, "scheduling": self.scheduling,
                "call_timeout": self.call_timeout, "drain_timeout": self.drain_timeout,
                "tensor_parallel_size": self.tensor_parallel_size,
                "known_failures": [entry.line for entry in self.known_entries],
                "known_failures_files": list(self.known_failures_files),
                "connector": {variable: os.environ.get(variable) for variable in CONNECTOR_VARIABLES},
                "kvconform": KIT_VERSION, "spec": registry.spec_version()}


CONNECTOR_VARIABLES = ("KVCONFORM_CONNECTOR", "KVCONFORM_CONNECTOR_CONFIG", "KVCONFORM_CONNECTOR_MANIFEST",
                       "KVCONFORM_PD_PROCESSES", "KVCONFORM_RANKS")
"""Where the connector that `vllm-connector` and `vllm-pd` build is named, the processes `vllm-pd` runs in, and where
`vllm-connector`'s tensor-parallel ranks run (`processes` by default, or `in-process`): set by --connector,
--connector-config, --connector-manifest, --pd-processes and --ranks (--kv-connector…, --kv-pd-processes and --kv-ranks
in pytest), read by the adapter, also in pytest-xdist workers."""


def select_connector(*values: str | None) -> None:
    """Name the connector, its config and its manifest, `vllm-pd`'s processes and where the ranks run; values not
    given are left as set."""
    for variable, value in zip(CONNECTOR_VARIABLES, values, strict=False):
        if value is not None:
            os.environ[variable] = value


def is_scheduling(name: str) -> TypeGuard[Scheduling]:
    """Return whether `name` is a scheduling mode a run can be asked for."""
    return name in SCHEDULINGS


def seed_words(seed: int | None) -> str:
    """Return how a run's programs are seeded, as its banner says it."""
    return f"seed {seed}" if seed is not None else "the profile's own seed"


def prepare(adapter_spec: str, *, profile: str = DEFAULT_PROFILE, seed: int | None = None,
            scheduling: str = "both", call_timeout: float = DEFAULT_CALL_TIMEOUT,
            known_failures_path: Path | None = None, report_path: Path | None = None,
            junit_path: Path | None = None, certify: bool = False,
            database: str = examples.DEFAULT_DATABASE,
            drain_timeout: float | str = DEFAULT_DRAIN_TIMEOUT,
            tensor_parallel_size: int | None = None, record_trace: Path | None = None) -> RunOptions:
    """Return the checked options of a run, or raise UsageProblem naming the first mistake.

    `database` is a directory, a Redis URL or `none` (`examples.open_database`)."""
    if profile not in PROFILES:
        raise UsageProblem(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if not is_scheduling(scheduling):
        raise UsageProblem(f"unknown scheduling {scheduling!r}; choose one of {', '.join(SCHEDULINGS)}")
    if not call_timeout > 0:
        raise UsageProblem(f"the call timeout must be more than 0 seconds, not {call_timeout:g}")
    drain_seconds = positive_seconds("the drain timeout", drain_timeout)
    for path in (report_path, junit_path, record_trace):
        if path is not None:
            check_writable(path)
    if known_failures_path is not None:
        _known_failures(known_failures_path)  # a mistake in the user's file is reported before the adapter is built
    try:
        database_opened = examples.open_database(database)
    except examples.DatabaseError as error:
        raise UsageProblem(str(error)) from None
    factory, capabilities, version, behaviours = _probe(adapter_spec, call_timeout)
    if scheduling == "async" and not capabilities.async_scheduling:
        raise UsageProblem(f"adapter {adapter_spec!r} does not support async scheduling (its capabilities say so)")
    if tensor_parallel_size is not None and tensor_parallel_size not in capabilities.tensor_parallel_sizes:
        raise UsageProblem(f"adapter {adapter_spec!r} runs tensor-parallel sizes "
                           f"{', '.join(map(str, capabilities.tensor_parallel_sizes))}, not {tensor_parallel_size} "
                           "(its capabilities say so)")
    shipped, ships_any = baseline.shipped(adapter_module(adapter_spec), version)
    files = tuple(path for path in (shipped, known_failures_path) if path is not None)
    files = files[:1] if len(files) == 2 and Path(str(files[0])).resolve() == Path(str(files[1])).resolve() else files
    unverified = None
    if ships_any and not shipped:
        unverified = (f"{version} has no verdict table in kvconform (no shipped known-failures file "
                      f"{version.replace(' ', '-')}.txt): a failure may be the release's own, not the adapter's")
    return RunOptions(adapter_spec, factory, capabilities, version, profile, seed, scheduling, call_timeout,
                      tuple(_known_failures(*files).listed), tuple(str(path) for path in files), unverified,
                      behaviours, report_path, junit_path, certify, database_opened, drain_seconds,
                      tensor_parallel_size, record_trace)


def _known_failures(*paths) -> baseline.Baseline:
    try:
        return baseline.load(*paths)
    except baseline.BaselineError as error:
        raise UsageProblem(str(error)) from None


def adapter_module(adapter_spec: str) -> str:
    """Return the module that defines the adapter `adapter_spec` names (a registered name or module:factory)."""
    return available().get(adapter_spec, adapter_spec).partition(":")[0]


def run(options: RunOptions, on_example: Callable[[], None] | None = None, shard: Shard = Shard(),
        on_shrink: Callable[[str], None] | None = None) -> report.RunReport:
    """Run the state machine as `options` say, or one `shard` of it, and return its report (not yet written); a long
    shrink says how far it got to `on_shrink`.

    A part of a split run finds no known failure stale: only the merge of all parts can (`report.merge`)."""
    result = runner.run(options.factory, options.adapter_spec, options.profile, options.seed, on_example=on_example,
                        call_timeout=options.call_timeout, scheduling=options.scheduling,
                        baseline=baseline.Baseline(list(options.known_entries), all_rare=shard.count > 1),
                        database=run_examples(options), shard=shard, drain_timeout=options.drain_timeout,
                        on_shrink=on_shrink, tensor_parallel_size=options.tensor_parallel_size,
                        capabilities=options.capabilities,
                        recorder=None if options.record_trace is None else Recorder(shard.trace(options.record_trace),
                                                                                    options.trace_header()))
    return report.build(result, options.implementation_version, options.capabilities, options.known_failures,
                        behaviours=list(options.behaviours), known_failures_files=list(options.known_failures_files))


def check(path: Path, on_example: Callable[[], None] | None = None) -> report.RunReport:
    """Judge the trace at `path` again (`runner.check`) and return its report, as the recorded run's; raise
    UsageProblem for a file that is not a trace this kit reads."""
    try:
        trace = Trace.read(path)
        recorded = trace.run
        known = baseline.Baseline(baseline.parse("\n".join(recorded["known_failures"]), f"{path}: known failures"))
        capabilities = Capabilities.model_validate(recorded["capabilities"])
    except (TraceError, baseline.BaselineError, ValueError) as error:
        raise UsageProblem(str(error)) from None
    try:
        result = runner.check(trace, known, on_example)
    except (TraceError, TraceMismatch) as error:
        raise UsageProblem(f"{error}; nothing after it was judged") from None
    return report.build(result, recorded["implementation"], capabilities, known.entries,
                        behaviours=list(recorded["behaviours"]),
                        known_failures_files=list(recorded["known_failures_files"]))


def run_examples(options: RunOptions) -> ExampleDatabase | None:
    """Return the part of the run's database that holds this kind of run's examples: the adapter, its implementation
    and connector, and the scheduling modes drawn (CONF-RUN-5)."""
    if options.database is None:
        return None
    connector = (os.environ.get(variable, "") for variable in CONNECTOR_VARIABLES)
    ranks = () if options.tensor_parallel_size is None else (f"tensor-parallel-size {options.tensor_parallel_size}",)
    return examples.RunExamples(options.database, (options.adapter_spec, options.implementation_version,
                                                   options.scheduling, *connector, *ranks))


def write_reports(run_report: report.RunReport, report_path: Path | None, junit_path: Path | None) -> None:
    """Write the JSON and JUnit reports asked for; raise UsageProblem when one cannot be written."""
    for path, render in ((report_path, lambda: run_report.model_dump_json(indent=2)),
                         (junit_path, lambda: report.junit_xml(run_report))):
        if path is not None:
            try:
                report.write_atomically(path, render())
            except OSError as error:
                raise UsageProblem(f"cannot write the report to {path}: {error.strerror or error}") from None


def certification_gaps(options: RunOptions, run_report: report.RunReport) -> list[str]:
    """Return why the run does not certify the adapter when `options` ask to certify, else nothing (CONF-CERT-1)."""
    return report.certification_gaps(run_report) if options.certify else []


def positive_seconds(what: str, value: float | str) -> float:
    """Return `value` as a finite positive number of seconds, or raise UsageProblem naming `what`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageProblem(f"{what} must be a positive number of seconds, not {value!r}")
    return seconds


def check_writable(path: Path) -> None:
    """Raise UsageProblem before a long run whose report could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageProblem(f"cannot write the report to {path}: {error.strerror or error}") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageProblem(f"cannot write the report to {path}: directory {path.parent} is not writable")


def _probe(adapter_spec: str, call_timeout: float
           ) -> tuple[Callable[[], KVConnectorAdapter], Capabilities, str, tuple[str, ...]]:
    """Return the adapter's factory, capabilities, version and behaviours, or raise UsageProblem when it cannot even be
    asked."""
    caller = AdapterCaller(call_timeout)
    try:
        factory = resolve(adapter_spec)
        caller.build(factory)
        capabilities, version = caller("capabilities"), caller("implementation_version")
        behaviours = tuple(caller("behaviours"))
        caller("close")
    except AdapterNotFound as error:
        raise UsageProblem(str(error)) from None
    except (ClauseViolation, AdapterHung) as error:
        if isinstance(error.__cause__, AdapterNotFound):
            raise UsageProblem(str(error.__cause__)) from None
        raise UsageProblem(f"adapter {adapter_spec!r} cannot be used: {error.detail}") from None
    return factory, capabilities, version, behaviours
