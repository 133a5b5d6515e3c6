"""Calling the adapter under test: every call is timed out, traced and its result validated (chapter `conformance`).

An adapter is untrusted code. Whatever it does — raise, return the wrong type or out-of-range values,
or never return — becomes a named clause failure; it never crashes the harness and never passes.
"""

from __future__ import annotations

import math
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from kvconform.adapters.contract import ImplementationFailure, KVConnectorAdapter
from kvconform.common.values import Capabilities, EngineConfig, ResourceUsage, StepObservation, StoreSnapshot
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.operations import call_text
from kvconform.conformance.recording import Recorder

DEFAULT_CALL_TIMEOUT = 30.0
"""Seconds one adapter call may take before its outcome is reported as unknown (CONF-CALL-2)."""

RETURNS: dict[str, type] = {
    "capabilities": Capabilities,
    "implementation_version": str,
    "behaviours": tuple,
    "step": StepObservation,
    "store_contents": StoreSnapshot,
    "resource_usage": ResourceUsage,
    "reset_prefix_cache": bool,
    "computed_kv": torch.Tensor,
    "stored_kv": torch.Tensor,
}
"""What each contract method returns; the others return nothing the harness reads."""


class AdapterHung(BaseException):
    """A call did not return in time: its outcome is unknown (CONF-CALL-2).

    A BaseException, so Hypothesis neither shrinks nor replays it: replaying a hang would only hang again.
    """

    clause = "CONF-CALL-2"

    def __init__(self, call: str, timeout: float | None, trace: list[str]) -> None:
        self.detail = (f"{call} did not return within {timeout:g}s; outcome unknown" if timeout is not None else
                       f"{call} has no recorded outcome: the trace ends inside the call; outcome unknown")
        super().__init__(f"[CONF-CALL-2] {self.detail}")
        self.trace = trace


class AdapterCaller:
    """Calls one adapter, recording every call: a failure is reported with the calls that led to it."""

    def __init__(self, timeout: float | None, recorder: Recorder | None = None) -> None:
        self.adapter: KVConnectorAdapter | None = None
        self.timeout = timeout
        self.recorder = recorder
        """Where every call and its outcome are recorded, for a run that writes a trace."""
        self.config: EngineConfig | None = None
        self.trace: list[str] = []
        self.hung = False
        self.seconds = 0.0

    def build(self, factory: Callable[[], KVConnectorAdapter]) -> KVConnectorAdapter:
        """Build the adapter under the failure rules of any call (CONF-CALL-1) but without the call timeout: building
        may import a whole engine (vLLM: 26 – 99 s measured on a busy 2-core machine), which is no hang
        (CONF-CALL-2)."""
        self.adapter = self._invoke("adapter = factory()", "build", (), factory, timed=False)
        return self.adapter

    def __call__(self, operation: str, *args: Any) -> Any:
        """Return the adapter's validated answer to `operation(*args)` (CONF-CALL-1, CONF-CALL-2, CONF-OBS-1)."""
        call = call_text(operation, args)
        value = self._invoke(call, operation, args, lambda: getattr(self.adapter, operation)(*args))
        if operation == "start":
            self.config = args[0]
        return self.validated(call, operation, value)

    def _invoke(self, call: str, operation: str, args: tuple[Any, ...], function: Callable[[], Any],
                timed: bool = True) -> Any:
        """Return what `function`, the adapter's `operation(*args)`, returns, recording the call and its outcome."""
        self.trace.append(call)
        if self.recorder is not None:
            self.recorder.call(operation, args)
        started = time.perf_counter()
        try:
            value = self._answer(call, function, timed)
        except AdapterHung:
            self.hung = True
            if self.recorder is not None:
                self.recorder.hung(self.timeout)
            raise
        except ClauseViolation as violation:
            if self.recorder is not None:
                self.recorder.raised(violation)
            raise
        finally:
            self.seconds += time.perf_counter() - started
        if self.recorder is not None:
            self.recorder.returned(value, time.perf_counter() - started)
        return value

    def _answer(self, call: str, function: Callable[[], Any], timed: bool) -> Any:
        """Return what `function` returns; its raise fails its clause (CONF-CALL-1), its hang CONF-CALL-2."""
        try:
            with _deadline(self.timeout if timed else None, call, self.trace):
                return function()
        except ImplementationFailure as failure:
            raise ClauseViolation(failure.clause, f"{call}: the implementation failed: {failure}",
                                  adapter_traceback=adapter_traceback(failure)) from failure
        except (Exception, SystemExit) as error:  # an adapter calling sys.exit must not end the run
            raise ClauseViolation("CONF-CALL-1", f"{call} raised {type(error).__name__}: {error}",
                                  adapter_traceback=adapter_traceback(error)) from error

    def validated(self, call: str, operation: str, value: Any) -> Any:
        """Return `value` if it is what the contract says `operation` returns, else fail CONF-OBS-1."""
        expected = RETURNS.get(operation)
        if expected is None:
            return value
        if not isinstance(value, expected) or (expected is bool and type(value) is not bool):
            raise ClauseViolation("CONF-OBS-1", f"{call} returned {type(value).__name__} {_short(value)}, "
                                                f"expected {expected.__name__}")
        if issubclass(expected, BaseModel):
            try:
                return expected.model_validate(value)
            except ValidationError as error:
                raise ClauseViolation("CONF-OBS-1", f"{call} returned an invalid {expected.__name__}: "
                                                    f"{_short(error)}") from None
        if isinstance(value, torch.Tensor):
            self._check_kv(call, value)
        return value

    def _check_kv(self, call: str, kv: torch.Tensor) -> None:
        """KV rows are `[tokens, token_width]` of the configured dtype (CONF-OBS-1)."""
        if self.config is None:
            raise RuntimeError(f"{call} before start(config): no configuration to check the KV against")
        width, dtype = self.config.token_width, getattr(torch, self.config.kv_dtype)
        if kv.dim() != 2 or kv.shape[1] != width or kv.dtype != dtype:
            raise ClauseViolation("CONF-OBS-1", f"{call} returned a {kv.dtype} tensor of shape {tuple(kv.shape)}, "
                                                f"expected {dtype} rows of width {width}")


def adapter_traceback(error: BaseException) -> str:
    """Return the traceback of an adapter's exception: as it was recorded, for one a trace replays (`recorded_
    traceback`), else its own."""
    return getattr(error, "recorded_traceback", None) or "".join(traceback.format_exception(error))


def _short(value: object, limit: int = 300) -> str:
    text = repr(value) if not isinstance(value, Exception) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


class _deadline:
    """Raise AdapterHung in the calling thread once `timeout` seconds pass (SIGALRM; main thread only).

    The alarm repeats every REPEAT seconds until the call ends: an exception raised while Python runs a
    garbage-collector callback is printed and dropped, and the hung call must not outlive that one alarm.
    Within `hang_detection()` the handler stays installed and a call only arms and disarms the timer.
    """

    REPEAT = 0.25
    current: _deadline | None = None
    """The call the alarm is armed for."""
    handler_held = False

    def __init__(self, timeout: float | None, call: str, trace: list[str]) -> None:
        self.armed = timeout is not None and threading.current_thread() is threading.main_thread()
        self.timeout = math.inf if timeout is None else timeout  # no timeout: the call may take forever
        self.call, self.trace = call, trace

    def __enter__(self) -> None:
        if self.armed:
            if not _deadline.handler_held:
                self.previous = signal.signal(signal.SIGALRM, _expire)
            _deadline.current = self
            signal.setitimer(signal.ITIMER_REAL, self.timeout, self.REPEAT)

    def __exit__(self, *exc_info: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _deadline.current = None
            if not _deadline.handler_held:
                signal.signal(signal.SIGALRM, self.previous)


def _expire(signum: int, frame: object) -> None:
    """The SIGALRM handler: the armed call did not return in time (CONF-CALL-2)."""
    expired = _deadline.current
    if expired is not None:  # else the alarm went off as the call returned
        raise AdapterHung(expired.call, expired.timeout, list(expired.trace))


@contextmanager
def hang_detection() -> Iterator[None]:
    """Hold the SIGALRM handler for a whole run, so that each adapter call only arms the timer (CONF-CALL-2)."""
    if threading.current_thread() is not threading.main_thread() or _deadline.handler_held:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _expire)
    _deadline.handler_held = True
    try:
        yield
    finally:
        _deadline.handler_held = False
        signal.signal(signal.SIGALRM, previous)
