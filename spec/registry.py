"""The clause registry, parsed from the spec's markdown: the markdown is the single source.

A clause is a level-2 heading `## ID — REQUIREMENT` (its RFC 2119 keyword) followed by a line naming the reference symbols that
realise it and the checks that test it, then the normative text:

    ## OFF-READ-1 — MUST

    Realised by `reference.connector.OffloadConnectorScheduler.get_num_new_matched_tokens` · checked by `check_skip_read`

    A request that must not read cached KV **MUST NOT** be looked up in the store.

A clause that no run-time check can judge against an adapter has, right after that line, a line
`Model-only: REASON` saying why: it is tested on the reference (and the kit) alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

HEADING = re.compile(r"^## (?P<id>[A-Z]+(?:-[A-Z]+)*-\d+) — (?P<requirement>MUST NOT|MUST|SHOULD|MAY)\s*$")
TRACE = re.compile(r"^Realised by (?P<symbols>.+?) · checked by (?P<checks>.+)$")
MODEL_ONLY = re.compile(r"^Model-only: (?P<reason>\S.*)$")
CODE = re.compile(r"`([^`]+)`")


CONNECTOR_LEVEL_CHAPTER = "08-connector-level.md"
CONFORMANCE_CHAPTER = "07-conformance.md"


@dataclass(frozen=True)
class Clause:
    id: str
    requirement: str
    chapter: str
    symbols: tuple[str, ...]
    checks: tuple[str, ...]
    text: str
    model_only: str | None = None
    """Why no run-time check judges the clause against an adapter; None for a clause judged at run time."""

    @property
    def spec_level(self) -> str | None:
        """Return the spec level the clause belongs to: "connector" (chapter 08), "offloading" (chapters 01 – 06),
        or None for the rules of judging itself (chapter 07), which hold at every level."""
        if self.chapter == CONFORMANCE_CHAPTER:
            return None
        return "connector" if self.chapter == CONNECTOR_LEVEL_CHAPTER else "offloading"


class SpecFormatError(ValueError):
    """A spec chapter does not follow the clause format; the message names the file and line."""


def chapters() -> list[str]:
    """Return the chapter file names, in reading order (the numeric prefix)."""
    return sorted(p.name for p in resources.files(__package__).iterdir() if re.match(r"\d\d-.*\.md$", p.name))


def parse_chapter(name: str, text: str) -> list[Clause]:
    """Return the clauses of one chapter's markdown."""
    clauses: list[Clause] = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        heading = HEADING.match(line)
        if not heading:
            continue
        body = [l for l in _until_next_heading(lines[number + 1 :]) if l.strip()]
        trace = TRACE.match(body[0]) if body else None
        if trace is None:
            raise SpecFormatError(f"{name}:{number + 2}: clause {heading['id']} lacks 'Realised by … · checked by …'")
        model_only = MODEL_ONLY.match(body[1]) if len(body) > 1 else None
        text = body[2:] if model_only else body[1:]
        clauses.append(Clause(heading["id"], heading["requirement"], name, tuple(CODE.findall(trace["symbols"])),
                              tuple(CODE.findall(trace["checks"])), "\n".join(text).strip(),
                              model_only and model_only["reason"]))
    return clauses


def _until_next_heading(lines: list[str]) -> list[str]:
    for index, line in enumerate(lines):
        if line.startswith("## ") or line.startswith("# "):
            return lines[:index]
    return lines


@cache
def clauses() -> dict[str, Clause]:
    """Return every clause of the spec by ID."""
    found: dict[str, Clause] = {}
    for name in chapters():
        for clause in parse_chapter(name, resources.files(__package__).joinpath(name).read_text()):
            if clause.id in found:
                raise SpecFormatError(f"{name}: clause {clause.id} is also defined in {found[clause.id].chapter}")
            found[clause.id] = clause
    return found


def spec_version() -> str:
    """Return the spec's SemVer version: the first `## x.y.z` heading of CHANGELOG.md."""
    changelog = resources.files(__package__).joinpath("CHANGELOG.md").read_text()
    match = re.search(r"^## (\d+\.\d+\.\d+)", changelog, re.MULTILINE)
    if match is None:
        raise SpecFormatError("CHANGELOG.md has no '## x.y.z' version heading")
    return match.group(1)
