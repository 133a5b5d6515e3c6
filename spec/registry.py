"""The clause registry, parsed from the spec's markdown: the markdown is the single source.

A clause is a level-2 heading `## ID — TITLE (REQUIREMENT)`: its stable ID, a short title that states the rule, and
its RFC 2119 keyword. The heading is followed by a line naming the reference symbols that realise it and the checks
that test it, then the normative text, then optionally a note on vLLM's releases and issues:

    ## LIFE-LIVE-1 — Every request finishes in bounded steps (MUST)

    Realised by `reference.engine.Engine.step` · checked by `check_drained`

    With every transfer completing, every request **MUST** finish within a bounded number of steps.

    History: vLLM #45388: loaded requests waited in plain queue order behind requests that could not fit.

A clause that no run-time check can judge against an adapter has, right after that line, a line
`Model-only: REASON` saying why: it is tested on the reference (and the kit) alone. The `History:` paragraph, if
any, is the clause's last: what vLLM releases do and which vLLM issues the rule comes from, kept out of the
normative text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

CLAUSE_ID = r"[A-Z]+(?:-[A-Z]+)*-\d+"
HEADING = re.compile(rf"^## (?P<id>{CLAUSE_ID}) — (?P<title>\S.*?) \((?P<requirement>MUST NOT|MUST|SHOULD|MAY)\)\s*$")
CLAUSE_HEADING = re.compile(rf"^## {CLAUSE_ID}\b")
TRACE = re.compile(r"^Realised by (?P<symbols>.+?) · checked by (?P<checks>.+)$")
MODEL_ONLY = re.compile(r"^Model-only: (?P<reason>\S.*)$")
HISTORY = re.compile(r"^History: (?P<note>\S.*)$", re.DOTALL)
CODE = re.compile(r"`([^`]+)`")


CONNECTOR_LEVEL_CHAPTER = "08-connector-level.md"
CONFORMANCE_CHAPTER = "07-conformance.md"
DISAGGREGATED_CHAPTER = "09-disaggregated.md"
EVENTS_CHAPTER = "10-kv-events.md"


@dataclass(frozen=True)
class Clause:
    id: str
    title: str
    requirement: str
    chapter: str
    symbols: tuple[str, ...]
    checks: tuple[str, ...]
    text: str
    model_only: str | None = None
    """Why no run-time check judges the clause against an adapter; None for a clause judged at run time."""
    history: str | None = None
    """What vLLM releases do and which vLLM issues the clause comes from: a note, not part of the rule."""

    @property
    def spec_level(self) -> str | None:
        """Return the spec level the clause belongs to: "connector" (chapter 08), "disaggregated" (chapter 09),
        "offloading" (chapters 01 – 06), "events" (chapter 10), or None for the rules of judging itself (chapter 07),
        which hold at every level."""
        if self.chapter == CONFORMANCE_CHAPTER:
            return None
        if self.chapter == DISAGGREGATED_CHAPTER:
            return "disaggregated"
        if self.chapter == EVENTS_CHAPTER:
            return "events"
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
            if CLAUSE_HEADING.match(line):
                raise SpecFormatError(f"{name}:{number + 1}: not '## ID — TITLE (REQUIREMENT)': {line}")
            continue
        paragraphs = _paragraphs(_until_next_heading(lines[number + 1 :]))
        trace = TRACE.match(paragraphs[0]) if paragraphs else None
        if trace is None:
            raise SpecFormatError(f"{name}:{number + 2}: clause {heading['id']} lacks 'Realised by … · checked by …'")
        model_only = MODEL_ONLY.match(paragraphs[1]) if len(paragraphs) > 1 else None
        rule = paragraphs[2:] if model_only else paragraphs[1:]
        history = HISTORY.match(rule[-1]) if rule else None
        if history:
            rule = rule[:-1]
        if any(HISTORY.match(paragraph) for paragraph in rule):
            raise SpecFormatError(f"{name}: clause {heading['id']}: its 'History:' note must be its last paragraph")
        clauses.append(Clause(heading["id"], heading["title"], heading["requirement"], name,
                              tuple(CODE.findall(trace["symbols"])), tuple(CODE.findall(trace["checks"])),
                              "\n\n".join(rule), model_only and model_only["reason"], history and history["note"]))
    return clauses


def _paragraphs(lines: list[str]) -> list[str]:
    """Return the paragraphs of a clause body: runs of non-blank lines, each joined by newlines."""
    return [p.strip() for p in re.split(r"\n[ \t]*\n", "\n".join(lines)) if p.strip()]


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
