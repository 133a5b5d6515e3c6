"""Known failures: clause failures an adapter is known to have, reported but not fatal (CONF-RUN-2).

A known-failures file is text in utf-8; `#` starts a comment, blank lines are ignored, and every other
line is an entry

    CLAUSE-ID [rare] /CAUSE/: reason

where `[rare]` and `/CAUSE/` are optional and the reason is mandatory (it should cite the
implementation's code). CAUSE is a Python regular expression (a `/` inside it written `\\/`) searched
in the failure's message: it tells this entry's cause from another failure of the same clause. A
failure of a listed clause is known when an entry of that clause matches it — the first, in the order
listed, whose cause is found in the message, an entry without a cause matching any — and fails the run
when none does. A clause may be listed more than once, each entry with its own cause. An entry never met
makes the run fail as stale, unless it is marked `[rare]`: a deviation only some programs reach, so that
a run may well not meet it.

An adapter package may ship the known failures of the implementation it drives, whatever adapter drives
it (a vLLM release's scheduler, shared by every vLLM adapter on that release), in its `known-failures/`
folder, named after the implementation's version (`vllm 0.24.0` → `vllm-0.24.0.txt`): `shipped` finds it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.spec import registry

if TYPE_CHECKING:  # annotations only; Python 3.10 has Traversable in importlib.abc, 3.11 moved it
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

ENTRY = re.compile(r"^(?P<clause>[A-Z]+(?:-[A-Z]+)*-\d+)\s*(?P<rare>\[rare\])?\s*"
                   r"(?:/(?P<cause>(?:[^/\\]|\\.)+)/)?\s*:\s*(?P<reason>\S.*)$")


class BaselineError(ValueError):
    """The known-failures file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Entry:
    """One known failure: a clause, the cause it is told by (a pattern on the failure's message, or any), why."""

    clause: str
    reason: str
    rare: bool = False
    cause: re.Pattern[str] | None = None

    @property
    def name(self) -> str:
        """The entry as the report names it: its clause, and its cause when it has one."""
        return self.clause if self.cause is None else f"{self.clause} /{self.cause.pattern}/"

    @property
    def line(self) -> str:
        """The entry as a known-failures file writes it (`parse` reads it back)."""
        cause = "" if self.cause is None else f" /{self.cause.pattern.replace('/', chr(92) + '/')}/"
        return f"{self.clause}{' [rare]' * self.rare}{cause}: {self.reason}"

    def matches(self, violation: ClauseViolation) -> bool:
        return violation.clause == self.clause and (self.cause is None or bool(self.cause.search(violation.detail)))


@dataclass
class Baseline:
    """The known failures of one run, how often each entry was met, and the first failure seen of each clause."""

    listed: list[Entry] = field(default_factory=list)
    met: Counter[str] = field(default_factory=Counter)
    """entry name -> how many failures it covered."""
    seen: dict[str, str] = field(default_factory=dict)
    """clause -> the message of its first known failure."""
    all_rare: bool = False
    """Whether no entry is stale however seldom it was met: a part of a split run (only the merge can tell)."""

    @property
    def entries(self) -> dict[str, str]:
        """clause -> reason, of every listed clause (the reasons of its entries joined)."""
        reasons: dict[str, list[str]] = {}
        for entry in self.listed:
            reasons.setdefault(entry.clause, []).append(entry.reason)
        return {clause: " | ".join(texts) for clause, texts in reasons.items()}

    @property
    def rare(self) -> set[str]:
        """The clauses every entry of which is rare."""
        return {entry.clause for entry in self.listed} - {entry.clause for entry in self.listed if not entry.rare}

    def tolerates(self, violation: ClauseViolation) -> bool:
        """Record `violation` and return True if an entry of its clause matches its cause (CONF-RUN-2)."""
        entry = next((entry for entry in self.listed if entry.matches(violation)), None)
        if entry is None:
            return False
        self.met[entry.name] += 1
        self.seen.setdefault(violation.clause, violation.detail)
        return True

    def stale(self) -> list[str]:
        """Return the entries never met, those marked rare aside."""
        if self.all_rare:
            return []
        return [entry.name for entry in self.listed if not entry.rare and not self.met[entry.name]]


def parse(text: str, origin: str) -> list[Entry]:
    """Return the entries of known-failures `text`, or raise BaselineError naming `origin` and the line."""
    known = registry.clauses()
    entries: list[Entry] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = ENTRY.match(line)
        if match is None:
            raise BaselineError(f"{origin}:{number}: expected 'CLAUSE-ID: reason', optionally "
                                f"'CLAUSE-ID [rare] /CAUSE/: reason', got {line!r}")
        if match["clause"] not in known:
            raise BaselineError(f"{origin}:{number}: {match['clause']} is not a clause of spec "
                                f"{registry.spec_version()}")
        try:
            cause = None if match["cause"] is None else re.compile(match["cause"].replace("\\/", "/"))
        except re.error as error:
            raise BaselineError(f"{origin}:{number}: the cause /{match['cause']}/ is not a regular expression: "
                                f"{error}") from None
        entry = Entry(match["clause"], match["reason"], bool(match["rare"]), cause)
        if any(other.name == entry.name for other in entries):
            raise BaselineError(f"{origin}:{number}: {entry.name} is listed twice; give each entry its own /CAUSE/")
        entries.append(entry)
    return entries


def load(*paths: Path | Traversable) -> Baseline:
    """Return the known failures of the files `paths`, in order, or raise BaselineError saying what is wrong."""
    entries: list[Entry] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise BaselineError(f"cannot read known-failures file {path}: {error}") from None
        for entry in parse(text, str(path)):
            if any(other.name == entry.name for other in entries):
                raise BaselineError(f"{path}: {entry.name} is listed in another known-failures file of this run too")
            entries.append(entry)
    return Baseline(entries)


def shipped(adapter_module: str, implementation_version: str) -> tuple[Traversable | None, bool]:
    """Return the known-failures file the package of `adapter_module` ships for the implementation it drives at
    `implementation_version` (None if none), and whether that package ships such files at all."""
    spec = importlib.util.find_spec(adapter_module)
    is_package = spec is not None and spec.submodule_search_locations is not None
    package = adapter_module if is_package else adapter_module.rpartition(".")[0]
    if not package:
        return None, False
    folder = resources.files(package).joinpath("known-failures")
    if not folder.is_dir():
        return None, False
    path = folder.joinpath(f"{implementation_version.replace(' ', '-')}.txt")
    return (path if path.is_file() else None), True
