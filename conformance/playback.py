"""Playing a trace back: the recorded adapter answers the kit's calls as the live one did (`kvconform check`).

A trace (`kvconform.common.trace`) is read into its examples; each is played back by a `Playback`, which an
execution drives as it drives a live adapter: the program's operations come from the trace, and the adapter a
`TracedAdapter` builds answers each call with the recorded outcome, the run's clock with the recorded reading. Every
record must be placed: a call the kit makes that the trace did not record, or one it records that the kit does not
make, is a `TraceMismatch`, never a silent pass.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconform.adapters.contract import ImplementationFailure, KVConnectorAdapter
from kvconform.common.trace import TraceError, decode, encode, read
from kvconform.conformance.calls import AdapterHung
from kvconform.conformance.operations import Call, ProgramError, call_text

Record = tuple[int, dict[str, Any]]
"""A trace record with its line number."""

OUTCOMES = ("return", "raise", "hang")
"""The records that can end a call."""


class TraceMismatch(BaseException):
    """The checker cannot place a record: the run it plays back does not make the calls the trace holds. A
    BaseException, so that no adapter-call handling turns it into a clause failure: the trace, not the adapter, is at
    fault, and nothing after it is judged."""


class RecordedError(Exception):
    """An exception an adapter raised, played back: named by a subclass of the recorded type's name, with its message
    and its traceback (`recorded_traceback`) as recorded."""

    recorded_traceback: str | None = None


@dataclass
class Trace:
    """A trace read whole: the run it recorded, and its examples' records."""

    path: Path
    run: dict[str, Any]
    examples: list[tuple[bool, list[Record]]]
    """Each example: whether it replays a judged program (a shrink's), and its records after its `example` record."""
    end: dict[str, Any] | None
    """The trace's `end` record; None where the recording stopped before the run did."""

    @classmethod
    def read(cls, path: Path) -> Trace:
        """Return the trace at `path`; raise TraceError for one that is not a trace of this format."""
        records = list(read(path))
        (_, header), body = records[0], records[1:]
        end = body.pop()[1] if body and body[-1][1]["record"] == "end" else None
        examples: list[tuple[bool, list[Record]]] = []
        for number, record in body:
            if record["record"] == "end":
                raise TraceError(f"{path}:{number}: an end record before the trace's last line")
            if record["record"] == "example":
                examples.append((bool(record["replay"]), []))
            elif not examples:
                raise TraceError(f"{path}:{number}: a {record['record']} record before the first example record")
            else:
                examples[-1][1].append((number, record))
        return cls(path, header["run"], examples, end)


@dataclass
class Playback:
    """One example's records, consumed in order by the execution that plays it back."""

    path: Path
    records: list[Record]
    position: int = 0
    calls: list[str] = field(default_factory=list)
    """The calls played so far, as the adapter caller names them (a hang's evidence)."""

    def where(self) -> str:
        return f"{self.path}:{self.records[self.position][0]}" if self.position < len(self.records) else \
            f"{self.path}, at the end of the example"

    def at(self, kind: str) -> bool:
        """Return True if the next record is of `kind`."""
        return self.position < len(self.records) and self.records[self.position][1]["record"] == kind

    def take(self, kind: str, wanted: str) -> dict[str, Any]:
        """Return the next record, which must be of `kind`; `wanted` says what the checker's run does there."""
        if not self.at(kind):
            found = (f"a {self.records[self.position][1]['record']} record" if self.position < len(self.records)
                     else "no more records")
            raise TraceMismatch(f"{self.where()}: the checker's run {wanted}, and the trace has {found} there")
        record = self.records[self.position][1]
        self.position += 1
        return record

    def operation(self) -> Call:
        """Return the next program operation of the example."""
        where = self.where()
        try:
            return Call.from_json(self.take("operation", "applies an operation")["call"])
        except ProgramError as error:
            raise TraceError(f"{where}: {error}") from None

    def now(self) -> float:
        """Return the clock reading the run made next (`judge.Run.now`)."""
        now = self.take("clock", "reads the clock")["now"]
        if not isinstance(now, (int, float)):
            raise TraceError(f"{self.path}:{self.records[self.position - 1][0]}: a clock reading {now!r}")
        return float(now)

    def answer(self, operation: str, args: tuple[Any, ...]) -> Any:
        """Return, or raise, what the adapter answered to `operation(*args)`, as recorded."""
        text = call_text(operation, args) if operation != "build" else "adapter = factory()"
        self.calls.append(text)
        where = self.where()
        record = self.take("call", f"calls {text}")
        if record["operation"] != operation:
            raise TraceMismatch(f"{where}: the checker's run calls {text}, and the trace recorded a call of "
                                f"{record['operation']} there")
        if record["args"] != encode(list(args)):
            raise TraceMismatch(f"{where}: the checker's run calls {text}, and the trace recorded it with other "
                                "arguments there")
        if not any(self.at(kind) for kind in OUTCOMES):
            if self.position == len(self.records):
                raise AdapterHung(text, None, list(self.calls))
            self.take("return", f"awaits the outcome of {text}")
        outcome = self.records[self.position][1]
        self.position += 1
        if outcome["record"] == "hang":
            raise AdapterHung(text, outcome["timeout"], list(self.calls))
        try:
            if outcome["record"] == "raise":
                error = recorded_exception(outcome)
            else:
                return decode(outcome["value"])
        except TraceError as unreadable:
            raise TraceMismatch(f"{self.path}:{self.records[self.position - 1][0]}: {unreadable}") from None
        raise error

    def abandon(self) -> None:
        """Skip to the example's recorded `close` call, past what the live run did after the point where the checker
        ended the example: its judges found a failure there that the live run's did not (a trace altered since), and
        an example ends at its first failure."""
        closes = [index for index in range(self.position, len(self.records))
                  if self.records[index][1]["record"] == "call" and self.records[index][1]["operation"] == "close"]
        self.position = closes[-1] if closes else len(self.records)

    def finished(self) -> None:
        """Raise TraceMismatch if records of the example are left that the checker's run never reached."""
        if self.position < len(self.records):
            raise TraceMismatch(f"{self.where()}: the checker's run ended the example here, and the trace has "
                                f"{len(self.records) - self.position} more records in it")


def recorded_exception(record: dict[str, Any]) -> Exception:
    """Return the exception a `raise` record holds: an implementation failure as one, any other as a RecordedError."""
    error: Exception
    if "clause" in record:
        error = ImplementationFailure(record["clause"], record["message"], recovered=record.get("recovered", False),
                                      result=decode(record.get("result")))
    else:
        error = type(record["type"], (RecordedError,), {})(record["message"])
    error.recorded_traceback = record["traceback"]  # type: ignore[attr-defined]
    return error


class TracedAdapter(KVConnectorAdapter):
    """The adapter a trace recorded, answering every contract call as it did (`Playback.answer`)."""

    def __init__(self, playback: Playback) -> None:
        self.playback = playback


def _played(operation: str) -> Any:
    def method(self: TracedAdapter, *args: Any) -> Any:
        return self.playback.answer(operation, args)

    method.__name__ = method.__qualname__ = operation
    method.__doc__ = f"Answer `{operation}` as the trace recorded it."
    return method


CONTRACT = tuple(name for name, _ in inspect.getmembers(KVConnectorAdapter, inspect.isfunction)
                 if not name.startswith("_"))
"""Every method of the adapter contract: what a traced adapter answers."""

for _operation in CONTRACT:
    setattr(TracedAdapter, _operation, _played(_operation))
TracedAdapter.__abstractmethods__ = frozenset()


def traced_factory(playback: Playback) -> Any:
    """Return the factory of an example's adapter: building it plays the recorded `build` back."""
    def build() -> TracedAdapter:
        playback.answer("build", ())
        return TracedAdapter(playback)  # type: ignore[abstract]  # every contract method is set: CONTRACT
    return build
