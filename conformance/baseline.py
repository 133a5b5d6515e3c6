"""Known failures: clause failures an adapter is known to have, reported but not fatal (CONF-RUN-2).

The file is text in utf-8; `#` starts a comment, blank lines are ignored, and every other line is
`CLAUSE-ID: reason` — the reason is mandatory and should cite the implementation's code. Listing a
clause lets the run go on past its failures; an entry that never fails makes the run fail as stale,
unless it is marked `CLAUSE-ID [rare]: reason`: a deviation that only some programs reach, so that a run
may well not meet it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvconform.conformance.checks import ClauseViolation
from kvconform.spec import registry

ENTRY = re.compile(r"^(?P<clause>[A-Z]+(?:-[A-Z]+)*-\d+)\s*(?P<rare>\[rare\])?\s*:\s*(?P<reason>\S.*)$")


class BaselineError(ValueError):
    """The known-failures file cannot be used; the message names the file and line."""


@dataclass
class Baseline:
    """The known failures of one run and the first failure seen of each."""

    entries: dict[str, str] = field(default_factory=dict)
    rare: set[str] = field(default_factory=set)
    seen: dict[str, str] = field(default_factory=dict)

    def tolerates(self, violation: ClauseViolation) -> bool:
        """Record `violation` and return True if its clause is a known failure (CONF-RUN-2)."""
        if violation.clause not in self.entries:
            return False
        self.seen.setdefault(violation.clause, violation.detail)
        return True

    def stale(self) -> list[str]:
        """Return the listed clauses that never failed, those marked rare aside."""
        return sorted(set(self.entries) - set(self.seen) - self.rare)


def load(path: Path) -> Baseline:
    """Return the baseline in `path`, or raise BaselineError saying what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BaselineError(f"cannot read known-failures file {path}: {error}") from None
    entries: dict[str, str] = {}
    rare: set[str] = set()
    known = registry.clauses()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        entry = ENTRY.match(line)
        if entry is None:
            raise BaselineError(f"{path}:{number}: expected 'CLAUSE-ID: reason', got {line!r}")
        if entry["clause"] not in known:
            raise BaselineError(f"{path}:{number}: {entry['clause']} is not a clause of spec {registry.spec_version()}")
        entries[entry["clause"]] = entry["reason"]
        if entry["rare"]:
            rare.add(entry["clause"])
    return Baseline(entries, rare)
