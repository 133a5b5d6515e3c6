"""Recording a run as a trace (`kvconform run --record-trace`; the format: `kvconform.common.trace`).

The recorder sits where the kit meets the adapter: the adapter caller tells it every call and its outcome, an
execution every example it builds an adapter for, every program operation it applies and every read of the run's
clock. What it writes is all a checker needs to judge the run again with the same judges (`playback.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvconform.adapters.contract import ImplementationFailure
from kvconform.common.trace import TraceWriter, encode
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.operations import Call


class Recorder:
    """Writes one run's trace, record by record, as the run makes them."""

    def __init__(self, path: Path, run: dict[str, Any]) -> None:
        self.writer = TraceWriter(path, run=run)

    def example(self, replay: bool) -> None:
        """A fresh adapter is about to be built; `replay`: for a program the run has judged already (a shrink)."""
        self.writer.write("example", replay=replay)

    def operation(self, call: Call) -> None:
        self.writer.write("operation", call=call.to_json())

    def call(self, operation: str, args: tuple[Any, ...]) -> None:
        self.writer.write("call", operation=operation, args=encode(list(args)))

    def returned(self, value: Any, seconds: float) -> None:
        self.writer.write("return", value=encode(value), seconds=round(seconds, 6))

    def raised(self, violation: ClauseViolation) -> None:
        """Record the exception behind `violation`, the failure of the call just recorded (CONF-CALL-1)."""
        error = violation.__cause__
        fields: dict[str, Any] = {"type": type(error).__name__, "message": str(error),
                                  "traceback": violation.adapter_traceback}
        if isinstance(error, ImplementationFailure):
            fields.update(clause=error.clause, recovered=error.recovered, result=encode(error.result))
        self.writer.write("raise", **fields)

    def hung(self, timeout: float | None) -> None:
        self.writer.write("hang", timeout=timeout)

    def clock(self, now: float) -> None:
        self.writer.write("clock", now=now)

    def close(self, examples: int, rules: int) -> None:
        """End the trace: the run drew `examples` examples and ran `rules` rules (`RunStatistics`)."""
        self.writer.close(examples, rules)
