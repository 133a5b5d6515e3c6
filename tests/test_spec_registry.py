"""Traceability: the spec's clauses, the reference symbols that realise them and the checks that test them agree."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from kvconform.conformance.judging.judge import CHECKS, check
from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.spec.registry import SpecFormatError, chapters, clauses, parse_chapter, spec_version

ROOT = Path(__file__).resolve().parent.parent
CLAUSE_ID = re.compile(r"\b[A-Z]{2,5}(?:-[A-Z]+)*-\d+\b")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
RELEASE_OR_ISSUE = re.compile(r"\b\d+\.\d+\.\d+\b|\b0\.\d\d\b|#\d{3,}")
NORMATIVE = re.compile(r"\*\*(MUST|MUST NOT|SHOULD|SHOULD NOT|MAY)\*\*")
CLAUSES = clauses()


def resolve(symbol: str) -> object:
    """Import the longest importable `kvconform.<prefix>` of a dotted symbol, then getattr the rest."""
    parts = symbol.split(".")
    for split in range(len(parts), 0, -1):
        module = "kvconform." + ".".join(parts[:split])
        try:
            found: object = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is not None and not module.startswith(error.name):
                raise
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(f"no module of kvconform.{symbol} can be imported")


def test_spec_has_clauses():
    assert len(CLAUSES) > 0


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_clause_has_checks_and_text(clause_id):
    clause = CLAUSES[clause_id]
    assert clause.checks, f"{clause_id} lists no check"
    assert clause.symbols, f"{clause_id} names no realising symbol"
    assert NORMATIVE.search(clause.text), f"{clause_id} has no normative keyword"


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_symbols_resolve(clause_id):
    for symbol in CLAUSES[clause_id].symbols:
        assert not symbol.startswith("kvconform."), f"{clause_id}: write {symbol!r} without the kvconform. prefix"
        resolve(symbol)


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_listed_checks_exist_and_are_registered(clause_id):
    for name in CLAUSES[clause_id].checks:
        if "::" in name:
            path, function = name.split("::", 1)
            file = ROOT / path
            assert file.is_file(), f"{clause_id}: {path} does not exist"
            defined = {node.name for node in ast.parse(file.read_text()).body if isinstance(node, ast.FunctionDef)}
            assert function in defined, f"{clause_id}: {path} defines no {function}()"
        else:
            assert name in CHECKS, f"{clause_id}: {name!r} is neither a registered check nor a pytest node id"
            assert clause_id in CHECKS[name].clauses, f"{clause_id} lists {name}, which is not registered for it"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_registrations_name_clauses_that_list_them(name):
    for clause_id in CHECKS[name].clauses:
        assert clause_id in CLAUSES, f"{name} is registered for {clause_id}, which the spec does not define"
        assert name in CLAUSES[clause_id].checks, f"{clause_id} does not list {name}, registered for it"


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_clause_is_judged_at_run_time_or_model_only(clause_id):
    """Every clause is judged against an adapter at run time by a registered check, or says why none can: one or
    the other, never both, never neither."""
    judged, reason = clause_id in run_time_clauses(), CLAUSES[clause_id].model_only
    assert judged or reason, f"{clause_id}: no registered check judges it; add one, or a 'Model-only: REASON' line"
    assert not (judged and reason), f"{clause_id} is marked model-only, yet a registered check judges it at run time"


def test_model_only_line_is_parsed_apart_from_the_text():
    """The line after the trace line, `Model-only: REASON`, is the reason, not part of the normative text."""
    chapter = ("## X-ONE-1 — One (MUST)\n\nRealised by `a.b` · checked by `c`\n\nModel-only: nothing shows it.\n\n"
               "It **MUST** hold.\n\n## X-ONE-2 — Two (MAY)\n\nRealised by `a.b` · checked by `c`\n\n"
               "It **MAY** hold.\n")
    first, second = parse_chapter("99-x.md", chapter)
    assert (first.model_only, first.text) == ("nothing shows it.", "It **MUST** hold.")
    assert (second.model_only, second.text) == (None, "It **MAY** hold.")


def test_heading_title_and_history_note_are_parsed_apart_from_the_text():
    """`## ID — TITLE (LEVEL)` gives the title and level; a last paragraph `History: …` is the note, and the
    paragraphs before it stay the normative text, paragraph breaks kept."""
    chapter = ("## X-ONE-1 — A rule, with a dash — inside (MUST NOT)\n\nRealised by `a.b` · checked by `c`\n\n"
               "It **MUST NOT** break.\n\nNor **MUST** it bend.\n\nHistory: vLLM 0.23 broke it\n(#12345).\n")
    (clause,) = parse_chapter("99-x.md", chapter)
    assert (clause.id, clause.title, clause.requirement) == ("X-ONE-1", "A rule, with a dash — inside", "MUST NOT")
    assert clause.text == "It **MUST NOT** break.\n\nNor **MUST** it bend."
    assert clause.history == "vLLM 0.23 broke it\n(#12345)."


@pytest.mark.parametrize("chapter", [
    "## X-ONE-1 — MUST\n\nRealised by `a.b` · checked by `c`\n\nIt **MUST** hold.\n",
    "## X-ONE-1 — A rule MUST\n\nRealised by `a.b` · checked by `c`\n\nIt **MUST** hold.\n",
    "## X-ONE-1 — A rule (MUST)\n\nRealised by `a.b` · checked by `c`\n\nHistory: before.\n\nIt **MUST** hold.\n",
], ids=["no-title", "level-not-in-parentheses", "history-before-the-rule"])
def test_a_malformed_clause_is_an_error_not_a_lost_clause(chapter):
    """A heading that starts with a clause ID but misses the format, or a History note that is not last, is
    refused: a clause is never silently left out of the registry."""
    with pytest.raises(SpecFormatError, match="X-ONE-1"):
        parse_chapter("99-x.md", chapter)


def test_every_clause_heading_of_the_chapters_is_a_clause():
    """Each `## ` heading of a chapter that starts with a clause ID is in the registry, once."""
    spec = ROOT / "spec"
    headings = [line.split()[1] for name in chapters() for line in (spec / name).read_text().splitlines()
                if re.match(r"## [A-Z]+(?:-[A-Z]+)*-\d+\b", line)]
    assert sorted(headings) == sorted(CLAUSES)


def test_titles_are_short_distinct_statements():
    """A title reads as a rule in a table of contents: short, no normative keyword, no final period, unique."""
    titles = [clause.title for clause in CLAUSES.values()]
    for clause in CLAUSES.values():
        assert len(clause.title) <= 64 and not clause.title.endswith("."), clause.id
        assert not re.search(r"\b(MUST|SHOULD|MAY)\b|`", clause.title), f"{clause.id}: {clause.title!r}"
    assert len(set(titles)) == len(titles), "two clauses share a title"


@pytest.mark.parametrize("clause_id", sorted(CLAUSES))
def test_release_history_is_a_note_not_the_rule(clause_id):
    """The normative text names no vLLM release or issue (those go to the clause's History note), and the note
    states no rule."""
    clause = CLAUSES[clause_id]
    assert not RELEASE_OR_ISSUE.search(clause.text), \
        f"{clause_id}: {RELEASE_OR_ISSUE.findall(clause.text)} in the normative text; move it to 'History:'"
    assert not (clause.history and NORMATIVE.search(clause.history)), f"{clause_id}: its History note states a rule"


def test_cited_clause_ids_exist():
    cited: dict[str, set[str]] = {}
    for folder in ("reference", "conformance", "adapters"):
        for file in sorted((ROOT / folder).rglob("*.py")):
            for clause_id in CLAUSE_ID.findall(file.read_text()):
                cited.setdefault(clause_id, set()).add(str(file.relative_to(ROOT)))
    missing = {clause_id: sorted(files) for clause_id, files in cited.items() if clause_id not in CLAUSES}
    assert not missing, f"cited but not in the spec: {missing}"


def test_clause_ids_cited_in_spec_text_exist():
    missing = {(c.id, ref) for c in CLAUSES.values()
               for ref in CLAUSE_ID.findall(f"{c.text} {c.model_only or ''} {c.history or ''}") if ref not in CLAUSES}
    assert not missing, f"clauses cite undefined clauses: {sorted(missing)}"


def test_pytest_tests_cite_their_clause():
    """Every reference test a clause lists names that clause in its docstring's first line."""
    trees: dict[str, ast.Module] = {}
    for clause in CLAUSES.values():
        for name in clause.checks:
            if "::" in name:
                path, function = name.split("::", 1)
                if path not in trees:
                    trees[path] = ast.parse((ROOT / path).read_text())
                tree = trees[path]
                node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
                first = (ast.get_docstring(node) or "").splitlines()[:1]
                assert first and clause.id in first[0], \
                    f"{name} is listed for {clause.id} but its docstring cites {first}"


def test_spec_version_is_semver():
    assert SEMVER.match(spec_version()), spec_version()


def overview_section(heading: str) -> str:
    """Return the text of one `## heading` section of spec/00-overview.md."""
    text = (ROOT / "spec" / "00-overview.md").read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def bullets(text: str) -> list[str]:
    """Return the `- ` bullets of a markdown list, each with its continuation lines joined."""
    return [" ".join(item.split()) for item in re.findall(r"^- (.+?(?:\n {2}.+)*)$", text, re.MULTILINE)]


def overview_levels() -> dict[str, str]:
    """Return the overview's level list: level name → its bullet (`- **name** — `chapters`: …`)."""
    found = {}
    for bullet in bullets(overview_section("Levels")):
        match = re.match(r"\*\*(\w+)\*\* — (.+)$", bullet)
        assert match, f"spec/00-overview.md, Levels: not '**level** — `chapter`, …: what it judges': {bullet}"
        found[match[1]] = match[2]
    return found


def test_overview_levels_agree_with_the_registry():
    """The overview lists each level of the registry (`Clause.spec_level`, `SpecLevel`) once, with exactly the
    chapters its clauses are in, and says a level is model-only exactly when no clause of it is judged at run time."""
    from typing import get_args

    from kvconform.common.values import SpecLevel

    levels = overview_levels()
    in_registry = {clause.spec_level for clause in CLAUSES.values()} - {None}
    assert set(levels) == in_registry == set(get_args(SpecLevel)), (sorted(levels), sorted(in_registry))
    for level, bullet in levels.items():
        chapters_of_level = {clause.chapter for clause in CLAUSES.values() if clause.spec_level == level}
        listed = set(re.findall(r"`(\d\d-[\w-]+\.md)`", bullet.split(":", 1)[0]))
        assert listed == chapters_of_level, f"{level}: the overview lists {sorted(listed)}, the registry has " \
                                            f"{sorted(chapters_of_level)}"
        judged = any(c.model_only is None for c in CLAUSES.values() if c.spec_level == level)
        assert ("model-only" in bullet) == (not judged), \
            f"{level}: {'a check judges its clauses at run time' if judged else 'no check judges it'}, yet the " \
            f"overview says {'it is' if 'model-only' in bullet else 'nothing of'} model-only: {bullet}"


def test_overview_scope_agrees_with_the_registry():
    """Every level whose clauses are judged at run time is covered (a Covered bullet names it first), no Covered
    bullet names a level the registry lacks, and no Not-covered bullet names a level, by its name or any of the
    names (in italics) its Levels bullet gives it."""
    scope = overview_section("Scope")
    covered_text, not_covered_text = scope.split("\nNot covered (yet):\n", 1)
    covered = {m[1] for bullet in bullets(covered_text) if (m := re.match(r"the (\w+) level:", bullet))}
    levels = overview_levels()
    judged = {c.spec_level for c in CLAUSES.values() if c.spec_level and c.model_only is None}
    assert judged <= covered <= set(levels), (sorted(judged), sorted(covered))
    for bullet in bullets(not_covered_text):
        for level, description in levels.items():
            for name in (f"{level} level", *re.findall(r"(?<!\*)\*([^*]+)\*(?!\*)", description)):
                assert name.lower() not in bullet.lower(), \
                    f"spec/00-overview.md lists {name!r} (the {level} level) as not covered: {bullet}"


def test_overview_lists_every_chapter_and_its_clause_ids():
    """The overview's chapter list names every chapter, in order, with the ID prefixes of all its clauses."""
    listed = re.findall(r"^\d+\. `(\d\d-[\w-]+\.md)` — (.+?):", overview_section("Chapters"), re.MULTILINE)
    assert [name for name, _ in listed] == [name for name in chapters() if name != "00-overview.md"]
    for name, prefixes in listed:
        starts = tuple(prefix.removesuffix("*") for prefix in re.findall(r"[A-Z]+(?:-[A-Z]+)*-\*", prefixes))
        unlisted = sorted(c.id for c in CLAUSES.values() if c.chapter == name and not c.id.startswith(starts))
        assert not unlisted, f"spec/00-overview.md, Chapters: {name} lists {prefixes}, not {unlisted}"


def test_a_second_check_of_a_name_already_registered_is_refused() -> None:
    """A check is known by its name: one from another module under a taken name would replace the first unseen (the
    events level's first `check_lookups` silently dropped the offloading level's), so registering it raises."""
    taken = next(iter(CHECKS.values()))

    def planted(*args: object) -> None:
        """A check under a taken name."""

    planted.__name__ = taken.name
    with pytest.raises(ValueError, match=f"two checks are named {taken.name}"):
        check(*taken.clauses, kind=taken.kind)(planted)
    assert CHECKS[taken.name] is taken
