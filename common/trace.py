"""The trace format: a conformance run as it happened, one JSON record a line (docs/trace-format.md).

A trace holds what crossed the adapter contract — every call the kit made, its arguments and its answer (a value, a
raise, or a hang) — with the program operation each call served and every read of the run's clock, so that a
checker can judge the run again, offline and without the implementation, and reach the same verdict
(`kvconform check`). Values are written by `encode`: JSON as it is, and a tagged object for what JSON has no form of
(a tuple, a set, a dict with keys that are not strings, a contract value, a tensor, anything else by its repr).

This module is the format alone, neutral ground: the kit writes and reads it (`conformance/recording.py`), and so may a
recorder inside an engine.
"""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from pydantic import BaseModel

from kvconform.common import values

FORMAT = "kvconform-trace"
VERSION = 1
"""The format version a trace's first record names; a checker refuses a version it does not know."""

RECORDS: dict[str, tuple[str, ...]] = {
    "trace": ("format", "version"),
    "example": ("replay",),
    "operation": ("call",),
    "call": ("operation", "args"),
    "return": ("value", "seconds"),
    "raise": ("type", "message", "traceback"),
    "hang": ("timeout",),
    "clock": ("now",),
    "end": ("examples", "rules"),
    "hook": ("side", "rank", "method", "at"),
    "state": ("at", "requests", "used_gpu_blocks"),
}
"""Each record kind -> the fields it must have (`record` names the kind):

- `trace`: the first record: the format, its version, and either the kit run's settings (`run`: adapter, profile,
  seed, …) or, for a recording of a real engine, the engine's (`engine`, `ENGINE_FIELDS`);
- `example`: a fresh adapter is built; `replay` says whether it re-runs a program the run already judged (a shrink);
- `operation`: the program operation (`{"op": …, "args": …}`, as programs are written) the calls after it serve;
- `call`: an adapter call is made (`build` is the adapter's construction), followed by exactly one of
- `return` (its value, and the seconds it took), `raise` (the exception's type name, message and traceback; an
  implementation failure adds `clause`, `recovered` and `result`) or `hang` (no answer within `timeout` seconds);
- `clock`: the run read its clock (`time.monotonic`): a judge's lease, a drain's deadline;
- `end`: the last record: the examples the run drew and the state-machine rules it ran. A trace without it was cut
  short.

A recording of a real engine (`adapters/vllm/recorder.py`) holds, after its header, only
- `hook`: a call the engine made to its connector: the `side` (scheduler or worker) and `rank` that made it, the
  `method`, when (`at`, the engine's `time.monotonic`), what the judge reads of its arguments and answer, or `raised`;
- `state`: after the scheduler's last call of a step, each live request's computed tokens and status, and the GPU
  blocks in use.
"""

RUN_FIELDS = ("adapter", "implementation", "behaviours", "capabilities", "profile", "seed", "scheduling",
              "drain_timeout", "tensor_parallel_size", "known_failures", "known_failures_files")
"""What the header's `run` must hold: all a checker reads to judge the run again and report it alike."""

ENGINE_FIELDS = ("side", "rank", "vllm", "connector", "block_size", "num_gpu_blocks", "max_num_batched_tokens",
                 "async_scheduling", "tensor_parallel_size", "worker_traces")
"""What the header's `engine` must hold: the engine a recording was made in, as the checker builds its config."""

MODELS: dict[str, type[BaseModel]] = {
    name: model for name, model in inspect.getmembers(values, inspect.isclass)
    if issubclass(model, BaseModel) and model.__module__ == values.__name__ and not name.startswith("_")}
"""The contract's values, by class name: what a `$model` tag names."""


def worker_trace(trace: Path, rank: int) -> Path:
    """Return the file a recorded engine's rank writes its worker side's calls to, beside the scheduler's `trace`."""
    return trace.with_name(f"{trace.stem}.worker-{rank}{trace.suffix}")


class TraceError(ValueError):
    """A trace the checker cannot use; the message names the file and the line."""


class Opaque:
    """A value with no form in the trace, read back as its type's name and its repr: whatever a contract check says
    of the original (its type is not the contract's) it says of this."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def encode(value: Any) -> Any:
    """Return `value` as JSON: as it is where JSON holds it, else tagged (`decode` reads it back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(item) for item in value]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [encode(item) for item in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: encode(item) for key, item in value.items()}
        return {"$dict": [[encode(key), encode(item)] for key, item in value.items()]}
    if type(value).__name__ in MODELS and isinstance(value, BaseModel):
        return {"$model": type(value).__name__, "fields": value.model_dump(mode="json")}
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        data = bytes(tensor.view(torch.uint8).flatten().tolist()) if tensor.numel() else b""
        return {"$tensor": {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                            "data": base64.b64encode(data).decode("ascii")}}
    return {"$opaque": type(value).__name__, "repr": repr(value)}


def decode(data: Any) -> Any:
    """Return the value `encode` wrote as `data`; raise TraceError for one it cannot read back."""
    try:
        return _decoded(data)
    except TraceError:
        raise
    except (ValueError, TypeError, KeyError, RuntimeError) as error:  # a value altered or cut: base64, shape, fields
        raise TraceError(f"an unreadable value: {type(error).__name__}: {str(error).splitlines()[0]}") from None


def _decoded(data: Any) -> Any:
    if isinstance(data, list):
        return [_decoded(item) for item in data]
    if not isinstance(data, dict):
        return data
    if "$tuple" in data:
        return tuple(_decoded(item) for item in data["$tuple"])
    if "$set" in data:
        return frozenset(_decoded(item) for item in data["$set"])
    if "$dict" in data:
        return {_decoded(key): _decoded(item) for key, item in data["$dict"]}
    if "$model" in data:
        model = MODELS.get(data["$model"])
        if model is None:
            raise TraceError(f"unknown contract value {data['$model']!r}")
        return model.model_validate(data["fields"])
    if "$tensor" in data:
        tensor = data["$tensor"]
        dtype = getattr(torch, tensor["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise TraceError(f"unknown tensor dtype {tensor['dtype']!r}")
        raw = bytearray(base64.b64decode(tensor["data"], validate=True))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(tensor["shape"])
    if "$opaque" in data:
        return type(data["$opaque"], (Opaque,), {})(data["repr"])
    if any(key.startswith("$") for key in data):
        raise TraceError(f"unknown value tag in {sorted(data)}")
    return {key: _decoded(item) for key, item in data.items()}


class TraceWriter:
    """Writes one trace, a record a line, flushed as written: a run that dies leaves every record made so far."""

    def __init__(self, path: Path, **header: dict[str, Any]) -> None:
        """Open `path` and write the header: the kit's `run`, or a recorded `engine`."""
        self.path = path
        self.file: IO[str] = path.open("w", encoding="utf-8")
        self.write("trace", format=FORMAT, version=VERSION, **header)

    def write(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"record": kind, **fields}, separators=(",", ":")) + "\n")
        self.file.flush()

    def close(self, examples: int, rules: int) -> None:
        self.write("end", examples=examples, rules=rules)
        self.file.close()


def _check_header(where: str, header: dict[str, Any]) -> None:
    """Raise TraceError unless the header holds a kit run's settings or a recorded engine's, whole."""
    kind = "run" if "run" in header else "engine"
    fields = header.get(kind)
    required = RUN_FIELDS if kind == "run" else ENGINE_FIELDS
    if not isinstance(fields, dict):
        raise TraceError(f"{where}: the trace header names neither the run it records ('run') nor the engine "
                         "('engine')")
    if not set(required) <= set(fields):
        raise TraceError(f"{where}: the trace header's {kind} lacks {', '.join(sorted(set(required) - set(fields)))}")


def header(path: Path) -> dict[str, Any]:
    """Return the header of the trace at `path` (its first record, checked); raise TraceError for a file that is not
    a trace of this version."""
    return next(read(path))[1]


def read(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield each record of the trace at `path` with its line number; raise TraceError for a file that is not a trace
    of this version, or a line that is not a record of it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"cannot read trace {path}: {error}") from None
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{where}: not a JSON record ({error.msg}): the trace is corrupt or was cut mid-record"
                             ) from None
        kind = record.get("record") if isinstance(record, dict) else None
        if kind not in RECORDS:
            raise TraceError(f"{where}: not a trace record: 'record' must be one of {', '.join(RECORDS)}")
        missing = [name for name in RECORDS[kind] if name not in record]
        if missing:
            raise TraceError(f"{where}: a {kind} record without {', '.join(missing)}")
        if number == 1 and (kind != "trace" or record["format"] != FORMAT):
            raise TraceError(f"{where}: not a {FORMAT} file: its first record must be the trace header")
        if number == 1 and record["version"] != VERSION:
            raise TraceError(f"{where}: trace format version {record['version']!r}; this checker reads version "
                             f"{VERSION}")
        if number == 1:
            _check_header(where, record)
        if number > 1 and kind == "trace":
            raise TraceError(f"{where}: a second trace header: two traces joined into one file")
        yield number, record
    if not lines:
        raise TraceError(f"{path}: an empty file, not a trace")
