"""The operations of a program: one table, from which calls, their JSON form and their capability gates follow.

A program is a list of `Call`s. The state machine draws them, the shrinker edits them, a counterexample is one,
and a scenario compiles to one (`scenarios.py`); `Execution.apply` runs each. `OPERATIONS` says, per operation,
its parameters (with the type a JSON value is read as), how its arguments are written in JSON, and what it needs
of the adapter's capabilities (CONF-CAP-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvconform.common.values import Capabilities, EngineConfig, RequestSpec, TransferOutcome


class ProgramError(ValueError):
    """A program in JSON that is not one: the message says which operation and why."""


@dataclass(frozen=True)
class Parameter:
    """One parameter of an operation: its name, and the type its JSON value is read as."""

    name: str
    kind: type = object
    optional: bool = False
    """Left out of the call (and of its JSON form) unless given; only a last parameter is."""

    def read(self, value: Any) -> Any:
        """Return the argument a JSON value stands for (a model from its fields, a bool as a bool)."""
        if issubclass(self.kind, BaseModel):
            return self.kind.model_validate(value)
        if self.kind is not object and not isinstance(value, self.kind):
            raise TypeError(f"{self.name} must be a {self.kind.__name__}, not {value!r}")
        return value

    def write(self, value: Any) -> Any:
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _needs(capability: str, what: str) -> Callable[[Capabilities, tuple[Any, ...]], str | None]:
    """Return a gate: the operation needs `capability` (a bool of Capabilities)."""
    return lambda capabilities, args: None if getattr(capabilities, capability) else (
        f"{what}, and the adapter reports {capability}=False")


def _completes_transfers(in_step: bool) -> Callable[[Capabilities, tuple[Any, ...]], str | None]:
    """Return the gate of an operation that completes the transfers in flight: the harness must hold them, inside a
    step only with `complete_in_step`, failing them only with `transfer_failures`."""
    def gate(capabilities: Capabilities, args: tuple[Any, ...]) -> str | None:
        outcome = (args[0] if args else None) if in_step else TransferOutcome(fail_loads=args[0], fail_stores=args[1])
        if outcome is None:
            return None
        what = "transfers completed inside a step" if in_step else "transfers completed by the harness"
        if not capabilities.harness_completes_transfers:
            return f"{what}, and the adapter reports harness_completes_transfers=False: its transfers complete on " \
                   "their own clock"
        if in_step and not capabilities.complete_in_step:
            return f"{what}, and the adapter reports complete_in_step=False"
        if (outcome.fail_loads or outcome.fail_stores) and not capabilities.transfer_failures:
            return "failed transfers, and the adapter reports transfer_failures=False"
        return None
    return gate


def _disaggregated(what: str) -> Callable[[Capabilities, tuple[Any, ...]], str | None]:
    """Return the gate of an operation of a producer/consumer pair: the adapter reports the disaggregated level."""
    return lambda capabilities, args: None if "disaggregated" in capabilities.levels else (
        f"{what}, and the adapter's levels {capabilities.levels} lack 'disaggregated': it drives one engine")


def _resets_connector(capabilities: Capabilities, args: tuple[Any, ...]) -> str | None:
    if args[0] and not capabilities.reset_connector:
        return "reset_prefix_cache(reset_connector=True), and the adapter reports reset_connector=False"
    return None


@dataclass(frozen=True)
class Operation:
    """An operation of programs: an adapter call, or `drain`."""

    name: str
    parameters: tuple[Parameter, ...] = ()
    spread: bool = False
    """In JSON, the one parameter's fields are the arguments (a config, a request), not the parameter by name."""
    needs: Callable[[Capabilities, tuple[Any, ...]], str | None] = lambda capabilities, args: None
    """Return why an adapter of these capabilities cannot run the call with these arguments, or None."""


OPERATIONS = {operation.name: operation for operation in (
    Operation("start", (Parameter("config", EngineConfig),), spread=True),
    Operation("add_request", (Parameter("request", RequestSpec),), spread=True),
    Operation("prefill", (Parameter("request", RequestSpec),), spread=True,
              needs=_disaggregated("prefill() on the producer")),
    Operation("decode", (Parameter("request", RequestSpec), Parameter("prefill_id", str),
                         Parameter("params", dict, optional=True)),
              needs=_disaggregated("decode() on the consumer")),
    Operation("step", (Parameter("complete_transfers", TransferOutcome, optional=True),),
              needs=_completes_transfers(in_step=True)),
    Operation("complete_transfers", (Parameter("fail_loads", bool), Parameter("fail_stores", bool)),
              needs=_completes_transfers(in_step=False)),
    Operation("abort", (Parameter("request_id", str),), needs=_needs("abort", "abort()")),
    Operation("preempt", (Parameter("request_id", str),), needs=_needs("preemption", "preempt()")),
    Operation("reset_prefix_cache", (Parameter("reset_connector", bool),), needs=_resets_connector),
    Operation("drain"),
)}
"""The operations of a program: the adapter operations, plus `drain` (complete transfers and step until the engine is
idle, then check for leaks and liveness).

A pair of engines (the disaggregated level) adds two: `prefill(request)` sends a request to the producer, and
`decode(request, prefill_id, params)` sends one to the consumer carrying the kv_transfer_params that request
`prefill_id` returned when it finished, each field of `params` replacing the returned one (a null removes it: a
malformed forward, PD-PARAMS-2); `add_request` then goes to the consumer without params. Every other operation is
the pair's: `step` steps both engines (`KVConnectorAdapter`)."""

CREATES_REQUEST = frozenset({"add_request", "prefill", "decode"})
"""The operations that send a new request (their first argument) to the engine or the pair."""

PARAMETERS = {name: tuple(parameter.name for parameter in operation.parameters)
              for name, operation in OPERATIONS.items()}
"""The names of each operation's parameters."""


def call_text(operation: str, args: tuple[Any, ...]) -> str:
    """Return an adapter call as Python, as programs, failures and hangs name it."""
    return f"adapter.{operation}({', '.join(map(repr, args))})"


@dataclass(frozen=True)
class Call:
    """One operation of a program, with its positional arguments."""

    operation: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.operation not in OPERATIONS:
            raise ProgramError(f"unknown operation {self.operation!r}; the operations are {', '.join(OPERATIONS)}")

    def __str__(self) -> str:
        if self.operation == "drain":
            return "drain(adapter)  # complete transfers, step until idle; the kit's drain then checks for leaks"
        return call_text(self.operation, self.args)

    @property
    def creates(self) -> str | None:
        """Return the id of the request this call creates (`add_request`, `prefill`, `decode`), or None."""
        return self.args[0].request_id if self.operation in CREATES_REQUEST else None

    def unsupported(self, capabilities: Capabilities) -> str | None:
        """Return why an adapter of `capabilities` cannot run this call, or None if it can (CONF-CAP-1)."""
        return OPERATIONS[self.operation].needs(capabilities, self.args)

    def to_json(self) -> dict[str, Any]:
        """Return the call as programs and scenarios write operations: `{"op": ..., "args": {...}}`."""
        operation = OPERATIONS[self.operation]
        if operation.spread:
            args = self.args[0].model_dump(mode="json", exclude_defaults=self.operation == "add_request")
        else:
            # A trailing optional parameter may be left out (`Call("step")`): the arguments may be fewer.
            given = zip(operation.parameters, self.args, strict=False)
            args = {parameter.name: parameter.write(value) for parameter, value in given}
        return {"op": self.operation, "args": args} if args else {"op": self.operation}

    @classmethod
    def from_json(cls, data: Any) -> Call:
        """Return the call that a `{"op": ..., "args": {...}}` object stands for; raise ProgramError if none."""
        operation = OPERATIONS.get(data.get("op", "")) if isinstance(data, dict) else None
        args = data.get("args", {}) if isinstance(data, dict) else None
        if operation is None or not isinstance(args, dict):
            raise ProgramError(f"{data!r}: 'op' must be one of {', '.join(OPERATIONS)}, 'args' an object")
        try:
            if operation.spread:
                return cls(operation.name, (operation.parameters[0].read(args),))
            unknown = set(args) - set(PARAMETERS[operation.name])
            if unknown:
                raise TypeError(f"unknown argument(s) {', '.join(sorted(unknown))}")
            return cls(operation.name, tuple(parameter.read(args[parameter.name]) for parameter in operation.parameters
                                             if parameter.name in args or not parameter.optional))
        except (KeyError, TypeError, ValueError) as error:
            raise ProgramError(f"{data!r}: {_one_line(error)}") from None


def _one_line(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"missing argument {error}" if isinstance(error, KeyError) else " ".join(lines[:3])


def render(program: list[Call]) -> str:
    """Return a program as Python that runs against an adapter: the imports of the values and of the `drain` it uses,
    then its calls, one a line, on `adapter`, a freshly built instance of the adapter under test (`exec` it with
    `{"adapter": adapter}`); empty for an empty program."""
    if not program:
        return ""
    values = sorted({type(arg).__name__ for call in program for arg in call.args if isinstance(arg, BaseModel)})
    imports = [f"from kvconform.common.values import {', '.join(values)}"] if values else []
    if any(call.operation == "drain" for call in program):
        imports.append("from kvconform.conformance.execution import drain")
    header = ["# adapter: a freshly built instance of the adapter under test", *imports, ""]
    return "\n".join([*header, *map(str, program)])


def requests_created(program: list[Call]) -> int:
    """Return how many requests a program creates: its `add_request`, `prefill` and `decode` calls."""
    return sum(call.creates is not None for call in program)
