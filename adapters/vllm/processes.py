"""Objects of the vLLM adapters in processes of their own, as vLLM's deployments run them: a tensor-parallel rank's
worker (`engine.RankWorker`), one process per rank as vLLM's multiprocess executor runs it, and a P/D pair's producer
engine (`pd.producer_server`), as a deployment runs the prefill engine apart from the decode one.

A `Server` is a plain interpreter, not a multiprocessing spawn (which would import the user's main script again),
started once per role (vLLM's import takes seconds) and reused for one object at a time: "open" builds the object with
the server's factory, every other call is a method of it. Calls and answers are plainly pickled over a socket pair: a
tensor by value (multiprocessing's pickler shares it only with a process of its own making). In a session of its own,
an interrupt is the adapter's process's to handle; the server ends when that process closes the connection. A server
that exits, or does not answer in time, ends the waiting call with one line (`ProcessLost`), never a hang, and is
replaced at the next `server` of its role.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

REPLY_SECONDS = 300
"""How long a server may take to answer one call (a vLLM import under load, then an engine's start) before it counts
as lost; the harness's own call deadline is shorter (CONF-CALL-2)."""


class ProcessLost(RuntimeError):
    """A server's process exited, or did not answer a call in time."""


class Server:
    """A process of its own that builds objects with `factory` ("module:function") and answers calls on the last one
    built. `what` names the process in what a lost one raises."""

    def __init__(self, what: str, factory: str, environment: dict[str, str] | None = None) -> None:
        self.what = what
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from kvconform.adapters.vllm.processes import serve; "
                                   "serve(int(sys.argv[1]), sys.argv[2])", str(theirs.fileno()), factory],
            pass_fds=(theirs.fileno(),), start_new_session=True, env={**os.environ, **(environment or {})})
        theirs.close()
        self.connection = Connection(ours.detach())
        self.ready = False

    def wait_ready(self) -> None:
        """Wait for the process's first answer: vLLM imported."""
        if not self.ready:
            self.answer("vLLM's import")
            self.ready = True

    def call(self, method: str, *args: Any) -> Any:
        """Call `method` of the process's object ("open" builds one) and return its result, or raise what it raised,
        with the process's traceback as a note."""
        self.send(method, *args)
        return self.answer(method)

    def send(self, method: str, *args: Any) -> None:
        """Send a call whose answer `answer` waits for: calls to several servers run at once."""
        self.wait_ready()
        try:
            self.connection.send_bytes(pickle.dumps((method, args)))
        except OSError:
            self.stop()
            raise ProcessLost(f"{self.what} exited (code {self.process.returncode}) before {method}") from None

    def answer(self, method: str) -> Any:
        """Return what the process answers to `method`, or raise it."""
        try:
            if not self.connection.poll(REPLY_SECONDS):
                raise ProcessLost(f"{self.what} did not answer {method} within {REPLY_SECONDS}s")
            outcome, value, trace = pickle.loads(self.connection.recv_bytes())
        except (EOFError, OSError):
            self.stop()
            raise ProcessLost(f"{self.what} exited (code {self.process.returncode}) during {method}") from None
        except BaseException:  # no answer in time, or the harness's deadline: the object's state is unknown
            self.stop()
            raise
        if outcome == "raised":
            value.add_note(f"raised in {self.what}:\n{trace}")
            raise value
        return value

    @property
    def alive(self) -> bool:
        """Whether the process runs and its connection is open."""
        return not self.connection.closed and self.process.poll() is None

    def stop(self) -> None:
        """End the process: its object's state is unknown, or this process exits."""
        self.connection.close()
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_servers: dict[str, Server] = {}


def server(role: str, what: str, factory: str, environment: dict[str, str] | None = None) -> Server:
    """Return this process's server of `role`, starting one (without waiting for its import) if none is alive."""
    if not _servers:
        atexit.register(stop_servers)
    if role not in _servers or not _servers[role].alive:
        _servers[role] = Server(what, factory, environment)
    return _servers[role]


def stop_servers(*roles: str) -> None:
    """End this process's servers of `roles` (all, as this process exits, if none is named) that are alive."""
    for role in roles or list(_servers):
        if role in _servers and _servers[role].alive:
            _servers.pop(role).stop()


def sendable(reply: tuple[str, Any, str]) -> bytes:
    """Return `reply` pickled; an error that does not pickle, or unpickle, is sent as a RuntimeError naming it."""
    outcome, value, trace = reply
    try:
        data = pickle.dumps(reply)
        if outcome == "raised":
            pickle.loads(data)
        return data
    except Exception as error:
        what = f"{type(value).__name__}: {value}" if outcome == "raised" else "the result"
        return pickle.dumps(("raised", ProcessLost(f"{what} cannot be sent back: {type(error).__name__}: {error}"),
                             trace))


def serve(descriptor: int, factory: str) -> None:
    """A server's process: build and drive one object at a time as the calls on the connection `descriptor` say, each
    answered with what it returned or raised, until the adapter's process closes the connection."""
    connection = Connection(descriptor)
    module, _, function = factory.partition(":")
    built: Any = None
    method, args = "load", ()  # the first answer: vLLM imported
    while True:
        try:
            if method == "load":
                from kvconform.adapters.vllm import runtime

                runtime.load()
                value = None
            elif method == "open":
                if built is not None and hasattr(built, "close"):
                    built.close()
                built, value = getattr(importlib.import_module(module), function)(*args), None
            else:
                value = getattr(built, method)(*args)
            reply = ("returned", value, "")
        except BaseException as error:
            reply = ("raised", error, traceback.format_exc())
        connection.send_bytes(sendable(reply))
        try:
            method, args = pickle.loads(connection.recv_bytes())
        except EOFError:  # the adapter's process closed it, or exited
            return
