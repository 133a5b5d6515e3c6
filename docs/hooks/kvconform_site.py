"""MkDocs hook: the site is generated from `spec/` and the code at build time; no clause text is copied.

- `on_config`: a nav entry naming a folder (`spec/`, `adapters/`, `source/`) becomes that folder's pages,
  so pages added there (generated or hand-written) appear without editing mkdocs.yml.
- `on_files`: adds the generated pages — the clause index, one page per spec chapter, the changelog,
  one page per source file that realises or checks a clause — and `report.schema.json`.
- `on_page_markdown`: in hand-written pages, a region `<!-- kvconform: NAME ARGS -->` … `<!-- /kvconform -->` is
  replaced by what `DIRECTIVES[NAME]` renders from the code; clause IDs anywhere in prose become links.

The home page is the README. A region in a page under `docs/` holds, between its two lines, the same content as
plain markdown for reading the page in the repository; `python docs/hooks/kvconform_site.py` rewrites every region
from the code, and tests/test_docs.py fails while one is out of date.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import click
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel

from kvconform import plugin
from kvconform.adapters.registry import resolve
from kvconform.cli import main as cli_main
from kvconform.common.values import Capabilities
from kvconform.conformance import report, scenarios
from kvconform.conformance.judging.judge import CHECKS
from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.spec import registry

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CLAUSES = registry.clauses()
CHAPTER_PAGES = {name: f"spec/{name}" for name in registry.chapters()} | {"CHANGELOG.md": "spec/changelog.md"}
CLAUSE_INDEX = "spec/index.md"
SCHEMA_FILE = "report.schema.json"
SCENARIO_SCHEMA_FILE = "scenario.schema.json"
DIRECTIVE = re.compile(r"^<!-- kvconform: (?P<name>[\w-]+)(?P<args>[^>]*?) -->\n"
                       r"(?:(?P<body>(?:(?!<!-- kvconform: ).)*?)^<!-- /kvconform -->$)?", re.MULTILINE | re.DOTALL)
REGION_END = "<!-- /kvconform -->"
HOME = "index.md"
CLAUSE_REF = re.compile(r"\b[A-Z]+(?:-[A-Z]+)*-\d+\b")
FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
MUTANT_COMMAND = ("kvconform", "run", "--adapter", "kvconform_test_mutant:make", "--scheduling", "sync")
CACHE = ROOT / ".cache" / "kvconform-docs"


class SiteError(PluginError):
    """The site cannot be built from this checkout; the message says why."""


# --- where things are defined ------------------------------------------------------------------


@dataclass(frozen=True)
class Definition:
    """A symbol, check or test: its file relative to the repository, its lines and its docstring."""

    name: str
    path: str
    first: int
    last: int
    doc: str
    node: ast.stmt = field(compare=False, repr=False)

    def source(self) -> str:
        lines = (ROOT / self.path).read_text().splitlines()[self.first - 1 : self.last]
        return textwrap.dedent("\n".join(lines))

    def page(self) -> str:
        return source_page(self.path)


@cache
def _module_tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def locate(path: str, qualname: list[str], name: str) -> Definition:
    """Return the definition of `qualname` (class, function or assignment, nested by `.`) in file `path`."""
    body: list[ast.stmt] = _module_tree(path).body
    for part in qualname:
        index = next((i for i, n in enumerate(body) if part in _names(n)), None)
        if index is None:
            raise SiteError(f"{name}: {path} defines no {'.'.join(qualname)}")
        node, following, body = body[index], body[index + 1 : index + 2], getattr(body[index], "body", [])
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return Definition(name, path, first, node.end_lineno, _docstring(node, following), node)


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _docstring(node: ast.stmt, following: list[ast.stmt]) -> str:
    """Return the docstring of a definition; an assignment's is the string statement after it, if any."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return ast.get_docstring(node) or ""
    after = following[0].value if following and isinstance(following[0], ast.Expr) else None
    return inspect.cleandoc(after.value) if isinstance(after, ast.Constant) and isinstance(after.value, str) else ""


def _repository_path(module: str) -> str:
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin).resolve()
    if not origin.is_relative_to(ROOT):
        raise SiteError(f"{module} is imported from {origin}, not from this checkout {ROOT}: pip install -e .")
    return origin.relative_to(ROOT).as_posix()


def symbol(name: str) -> Definition:
    """Return where a spec symbol (a dotted path under the kvconform package) is defined."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = "kvconform." + ".".join(parts[:split])
        try:
            if importlib.util.find_spec(module) is not None:
                return locate(_repository_path(module), parts[split:], name)
        except ModuleNotFoundError:
            continue
    raise SiteError(f"spec symbol {name}: no module of kvconform.{name} can be found")


def check(name: str) -> Definition:
    """Return where a registered check or a pytest node id (`tests/file.py::test_name`) is defined."""
    if "::" in name:
        path, function = name.split("::", 1)
        return locate(path, [function], name)
    function = CHECKS[name].function
    return locate(_repository_path(function.__module__), function.__qualname__.split("."), name)


def source_page(path: str) -> str:
    return f"source/{path}.md"


PACKAGE_FOLDERS = ("adapters", "benchmarks", "conformance", "kvconform", "reference", "spec")


@cache
def source_files() -> dict[str, list[str]]:
    """Return the files shown on the site — the kit's own, and the tests that check a clause — with the
    clauses each realises or checks."""
    served: dict[str, list[str]] = {p.relative_to(ROOT).as_posix(): [] for folder in PACKAGE_FOLDERS
                                    for p in (ROOT / folder).rglob("*.py") if p.stat().st_size}
    for clause in CLAUSES.values():
        for definition in [*map(symbol, clause.symbols), *map(check, clause.checks)]:
            ids = served.setdefault(definition.path, [])
            if clause.id not in ids:
                ids.append(clause.id)
    return dict(sorted(served.items()))


# --- markdown helpers --------------------------------------------------------------------------


def link(target: str, page: str) -> str:
    """Return the relative link from page `page` to `target` (both docs paths, `target` may carry an anchor)."""
    path, _, anchor = target.partition("#")
    relative = posixpath.relpath(path, posixpath.dirname(page)) if path != page else ""
    return relative + (f"#{anchor}" if anchor else "")


def clause_link(clause_id: str, page: str) -> str:
    return link(f"{CHAPTER_PAGES[CLAUSES[clause_id].chapter]}#{clause_id}", page)


def linkify(markdown: str, page: str) -> str:
    """Turn clause IDs in prose into links, and `NN-chapter.md` code spans into links to the chapter's page.

    Code (fences and spans), headings and admonition titles are left as they are.
    """
    out, position = [], 0
    for fence in FENCE.finditer(markdown):
        out += [_linkify_prose(markdown[position : fence.start()], page), fence.group(0)]
        position = fence.end()
    out.append(_linkify_prose(markdown[position:], page))
    return "".join(out)


def _linkify_prose(text: str, page: str) -> str:
    return "\n".join(_linkify_line(line, page) for line in text.split("\n"))


def _linkify_line(line: str, page: str) -> str:
    if line.lstrip().startswith(("#", "???", "!!!")):
        return line
    parts = re.split(r"(`[^`\n]*`)", line)
    for index, part in enumerate(parts):
        if index % 2:
            name = part.strip("`")
            if name in CHAPTER_PAGES:
                parts[index] = f"[{part}]({link(CHAPTER_PAGES[name], page)})"
        else:
            parts[index] = CLAUSE_REF.sub(
                lambda m: f"[{m[0]}]({clause_link(m[0], page)})" if m[0] in CLAUSES else m[0], part)
    return "".join(parts)


def fenced(code: str, language: str = "python", first_line: int | None = None) -> str:
    """Return `code` as a fenced block (longer fence than any backtick run inside): a source listing numbered from
    `first_line`, which scrolls sideways; without it, long lines wrap within the page (docs/stylesheets)."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", code)), default=0))
    numbers = f' linenums="{first_line}"' if first_line is not None else ""
    return f"{fence}{language}{numbers}\n{code}\n{fence}"


def collapsible(kind: str, title: str, body: str) -> str:
    return f'??? {kind} "{admonition_title(title)}"\n\n{textwrap.indent(body, "    ")}\n'


def where(definition: Definition, page: str, text: str | None = None) -> str:
    """Return a link to the definition's first line on its source page."""
    target = f"{link(definition.page(), page)}#__codelineno-0-{definition.first}"
    return f"[{text or f'{definition.path}, line {definition.first}'}]({target})"


def definition_block(kind: str, title: str, definition: Definition, page: str, intro: str = "") -> str:
    """Return a collapsed block: a link to the definition's lines in its source page, then its source."""
    body = f"{intro}{where(definition, page)}\n\n{fenced(definition.source(), first_line=definition.first)}"
    return collapsible(kind, title, body)


SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z`(\[]|\s*$)")


def summary(doc: str) -> str:
    """Return the first sentence of a docstring's first paragraph, whole even where it runs over several lines."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    end = SENTENCE_END.search(paragraph)
    return paragraph[: end.end()] if end else paragraph


def admonition_title(text: str) -> str:
    """Return `text` fit for an admonition's quoted title."""
    return text.replace('"', "&quot;")


# --- generated pages ---------------------------------------------------------------------------


def requirement_badge(requirement: str) -> str:
    return (f'<span class="kv-requirement kv-requirement-{requirement.lower().replace(" ", "-")}">'
            f'{requirement}</span>')


def run_time_note(clause: registry.Clause, page: str) -> str:
    """Return how the clause is judged: by the registered checks that judge it against an adapter at run time, or,
    model-only, why none can."""
    if clause.model_only:
        reason = clause.model_only[0].upper() + clause.model_only[1:]
        return f'!!! note "Model-only: not judged against an adapter at run time"\n\n    {linkify(reason, page)}\n'
    checks = ", ".join(f"`{name}`" for name in clause.checks if name in CHECKS)
    adapters = f"adapter judged at the {clause.spec_level} level" if clause.spec_level else "adapter"
    return f'!!! success "Judged at run time"\n\n    By {checks}, against every {adapters}.\n'


def clause_heading(clause: registry.Clause) -> str:
    """Return a clause's heading: its ID (the anchor) and title, then its requirement badge; the table of contents
    lists it as `ID — title`."""
    label = admonition_title(f"{clause.id} — {clause.title}")
    attributes = f'{{ #{clause.id} data-toc-label="{label}" }}'
    return f"## {clause.id} — {clause.title} {requirement_badge(clause.requirement)} {attributes}"


def history_note(clause: registry.Clause, page: str) -> str:
    """Return the clause's History note (vLLM releases and issues), set apart from the rule, or nothing."""
    if not clause.history:
        return ""
    return f'!!! info "History: vLLM releases and issues"\n\n{textwrap.indent(linkify(clause.history, page), "    ")}\n'


def clause_section(clause: registry.Clause, page: str) -> str:
    """Return a clause as markdown: anchored heading with title and requirement badge, text, its History note, how
    it is judged, realising code, checks."""
    parts = [clause_heading(clause), linkify(clause.text, page), history_note(clause, page),
             run_time_note(clause, page), "**Realised by**"]
    for name in clause.symbols:
        definition = symbol(name)
        described = f" — {summary(definition.doc)}" if definition.doc else ""
        parts.append(definition_block("quote", f"`{name}`{described}", definition, page))
    parts.append("**Checked by**")
    for name in clause.checks:
        definition = check(name)
        if "::" in name:
            title = f"unit test `{name.split('::')[1]}` — {summary(definition.doc)}"
            parts.append(definition_block("example", title, definition, page, intro=f"`{name}`: "))
        else:
            others = ", ".join(f"[{c}]({clause_link(c, page)})" for c in CHECKS[name].clauses)
            intro = f"Registered run-time check (kind `{CHECKS[name].kind}`) of {others}: "
            title = f"check `{name}` — {summary(definition.doc)}"
            parts.append(definition_block("success", title, definition, page, intro))
    return "\n\n".join(part for part in parts if part) + "\n"


def chapter_page(name: str) -> str:
    """Return the page of one spec chapter: its prose as written, its clauses rendered by `clause_section`."""
    page = CHAPTER_PAGES[name]
    text = (ROOT / "spec" / name).read_text()
    clauses = {clause.id: clause for clause in registry.parse_chapter(name, text)}
    sections = re.split(r"(?m)^(?=## )", text)
    title, _, intro = sections[0].partition("\n")
    out = [f"{title}\n\n*kvconform spec {registry.spec_version()} — generated from `spec/{name}`; "
           f"edit that file, not this page.*\n{linkify(intro, page)}"]
    for section in sections[1:]:
        heading = registry.HEADING.match(section.split("\n", 1)[0])
        out.append(clause_section(clauses[heading["id"]], page) if heading else linkify(section, page))
    return "\n".join(out)


def clause_index_page() -> str:
    """Return the clause index: run-time coverage per spec level, then one row per clause with how it is judged."""
    rows = ["| clause | rule | requirement | spec level | chapter | judged at run time by | unit tests |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for clause in CLAUSES.values():
        checks = ", ".join(f"`{c}`" for c in clause.checks if c in CHECKS) or "model-only"
        unit_tests = sum("::" in c for c in clause.checks)
        chapter = f"[{chapter_title(clause.chapter)}]({link(CHAPTER_PAGES[clause.chapter], CLAUSE_INDEX)})"
        rows.append(f"| [{clause.id}]({clause_link(clause.id, CLAUSE_INDEX)}) | {clause.title} "
                    f"| {requirement_badge(clause.requirement)} "
                    f"| {clause.spec_level or 'every'} | {chapter} | {checks} | {unit_tests} |")
    return (f"# Clause index\n\nkvconform spec {registry.spec_version()}: {len(CLAUSES)} clauses. A clause is judged "
            f"against every adapter at run time by a registered check, or is model-only: its section says why no "
            f"check can judge it, and it is tested on the reference alone.\n\n{coverage_table()}\n\n"
            + "\n".join(rows) + "\n")


def coverage_table() -> str:
    """Return the run-time coverage of the MUST and MUST NOT clauses, per spec level and for a run judging both."""
    judged = run_time_clauses()
    must = [c for c in CLAUSES.values() if c.requirement.startswith("MUST")]
    groups = {"connector level (chapter 08)": ["connector"], "offloading level (chapters 01 – 06)": ["offloading"],
              "rules of judging (chapter 07)": [None], "a run judging both levels": ["connector", "offloading", None],
              "disaggregated level (chapter 09)": ["disaggregated"]}
    rows = ["| MUST and MUST NOT clauses of | judged at run time | model-only |", "| --- | --- | --- |"]
    for name, levels in groups.items():
        counted = [c for c in must if c.spec_level in levels]
        run_time = sum(c.id in judged for c in counted)
        rows.append(f"| {name} | {run_time} of {len(counted)} ({run_time / len(counted):.0%}) "
                    f"| {len(counted) - run_time} |")
    return "\n".join(rows)


def chapter_title(name: str) -> str:
    return (ROOT / "spec" / name).read_text().split("\n", 1)[0].removeprefix("# ")


def source_file_page(path: str, clause_ids: list[str]) -> str:
    page = source_page(path)
    links = ", ".join(f"[{c}]({clause_link(c, page)})" for c in clause_ids)
    served = f"Realises or checks {links}.\n\n" if clause_ids else ""
    front_matter = "---\nhide:\n  - toc\n---\n\n"  # a source page has no headings; give the code the room
    return f"{front_matter}# `{path}`\n\n{served}{fenced((ROOT / path).read_text().rstrip(), first_line=1)}\n"


def home_page() -> str:
    """Return the home page: the README, whose links to `docs/` pages become links to the site's pages."""
    return linkify((ROOT / "README.md").read_text().replace("](docs/", "]("), HOME)


@cache
def generated_pages() -> dict[str, str]:
    """Return every generated page, docs path -> markdown, in navigation order."""
    changelog = CHAPTER_PAGES["CHANGELOG.md"]
    pages = {HOME: home_page(), CLAUSE_INDEX: clause_index_page()}
    pages |= {CHAPTER_PAGES[name]: chapter_page(name) for name in registry.chapters()}
    pages[changelog] = linkify((ROOT / "spec" / "CHANGELOG.md").read_text(), changelog)
    pages |= {source_page(path): source_file_page(path, ids) for path, ids in source_files().items()}
    return pages


def report_schema() -> str:
    return json_schema(report.RunReport)


def scenario_schema() -> str:
    return json_schema(scenarios.ScenarioFile)


def json_schema(model: type[BaseModel]) -> str:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **model.model_json_schema()}
    return json.dumps(schema, indent=2) + "\n"


# --- the seed-bug mutant run shown in the docs --------------------------------------------------


def mutant_run() -> dict[str, str]:
    """Return the CLI output and JSON report of `MUTANT_COMMAND`, run now or cached for this exact source."""
    watched = sorted(p for folder in PACKAGE_FOLDERS
                     for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".json"))
    digest = hashlib.sha256()
    for path in [*watched, ROOT / "tests" / "kvconform_test_mutant.py"]:
        digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    cached = CACHE / f"mutant-run-{digest.hexdigest()[:16]}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "mutant.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "COLUMNS": "400", "NO_COLOR": "1"}
        command = [sys.executable, "-m", "kvconform.cli", *MUTANT_COMMAND[1:], "--report", str(report_path)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        written = report_path.read_text() if report_path.is_file() else "{}"
    if done.returncode != 1 or json.loads(written).get("failed_clause") != "OFF-READ-1":
        raise SiteError(f"the seed-bug mutant no longer fails OFF-READ-1 (exit {done.returncode}): "
                        f"{done.stderr[-2000:]}")
    result = {"stdout": done.stdout, "report": written}
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result))
    return result


def abridged_report() -> report.RunReport:
    """Return the mutant run's report with its clauses cut to the first two and the failed one."""
    full = report.RunReport.model_validate_json(mutant_run()["report"])
    kept = [c for number, c in enumerate(full.clauses) if number < 2 or c.verdict == "fail"]
    return full.model_copy(update={"clauses": kept})


# --- directives in hand-written pages ----------------------------------------------------------


def directive_counterexample(args: list[str], page: str) -> str:
    run = mutant_run()
    tail = run["stdout"][run["stdout"].index("NOT conformant"):].rstrip()
    return (f"{fenced('PYTHONPATH=tests ' + ' '.join(MUTANT_COMMAND), 'sh')}\n\n"
            f"prints its run-time coverage line and the clauses that failed or were not exercised, then:\n\n"
            f"{fenced(tail, 'text')}\n")


def directive_coverage_line(args: list[str], page: str) -> str:
    """Return the run-time coverage line the mutant run printed."""
    return fenced(mutant_run()["stdout"].splitlines()[0], "text")


def directive_example_report(args: list[str], page: str) -> str:
    """Return the abridged report of the mutant run as `json` or `junit`."""
    abridged = abridged_report()
    if args == ["json"]:
        return fenced(abridged.model_dump_json(indent=2), "json")
    if args == ["junit"]:
        return fenced(report.junit_xml(abridged), "xml")
    raise SiteError(f"{page}: example-report takes json or junit, not {' '.join(args)!r}")


def directive_report_schema(args: list[str], page: str) -> str:
    return (f"Published as [`{SCHEMA_FILE}`]({link(SCHEMA_FILE, page)}).\n\n"
            + collapsible("abstract", f"The JSON schema of `RunReport` (spec {registry.spec_version()})",
                          fenced(report_schema().rstrip(), "json")))


def directive_scenario_schema(args: list[str], page: str) -> str:
    return (f"Published as [`{SCENARIO_SCHEMA_FILE}`]({link(SCENARIO_SCHEMA_FILE, page)}).\n\n"
            + collapsible("abstract", f"The JSON schema of a scenario file (spec {registry.spec_version()})",
                          fenced(scenario_schema().rstrip(), "json")))


def directive_scenario_library(args: list[str], page: str) -> str:
    """Return the bundled scenarios: name, level, the clause each illustrates and what it shows."""
    rows = ["| scenario | level | clause | what it shows |", "| --- | --- | --- | --- |"]
    for name in scenarios.bundled():
        scenario = scenarios.load(name)
        rows.append(f"| `{name}` | {scenario.level} | {scenario.clause} | {scenario.description} |")
    return "\n".join(rows) + "\n"


def directive_model(args: list[str], page: str) -> str:
    """Return a table of a pydantic model's fields: name, type as written in the source, default, description."""
    definition, model = symbol(args[0]), import_symbol(args[0])
    source = (ROOT / definition.path).read_text()
    written = {node.target.id: ast.get_source_segment(source, node.annotation)
               for node in definition.node.body if isinstance(node, ast.AnnAssign)}
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        default = "required" if info.is_required() else f"`{info.get_default(call_default_factory=True)!r}`"
        rows.append(f"| `{name}` | `{written[name]}` | {default} | {info.description or ''} |")
    title = where(definition, page, f"`{args[0].rpartition('.')[2]}`")
    return f"**{title}** — {summary(definition.doc)}\n\n" + "\n".join(rows) + "\n"


def directive_source(args: list[str], page: str) -> str:
    definition = symbol(args[0])
    return f"{where(definition, page)}\n\n{fenced(definition.source(), first_line=definition.first)}\n"


def directive_capabilities(args: list[str], page: str) -> str:
    """Return what an adapter declares: its implementation version and capability manifest, asked from the code."""
    adapter = resolve(args[0])()
    try:
        capabilities, version = adapter.capabilities(), adapter.implementation_version()
    finally:
        adapter.close()
    described = Capabilities.model_fields
    rows = ["| capability | declared | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | `{value!r}` | {described[name].description or ''} |"
             for name, value in capabilities.model_dump().items()]
    return f"Implementation version `{version}`. Capabilities:\n\n" + "\n".join(rows) + "\n"


def directive_release_matrix(args: list[str], page: str) -> str:
    """Return the release matrix (docs/release-matrix.json, written by `kvconform matrix`): a verdict per adapter and
    release, then every known-failure entry a cell met, with its class."""
    from kvconform.releases import ReleaseMatrix

    matrix = ReleaseMatrix.model_validate_json((DOCS / "release-matrix.json").read_text(encoding="utf-8"))
    releases = sorted({cell.release for cell in matrix.cells}, key=lambda v: tuple(map(int, v.split("."))))
    rows = list(dict.fromkeys(cell.row for cell in matrix.cells))
    cells = {(cell.row, cell.release): cell for cell in matrix.cells}

    def verdict(cell) -> str:
        if cell is None:
            return "not run"
        met = sum(entry.met for entry in cell.entries)
        said = {"ok": "conformant", "fail": f"**fails {cell.failed_clause}**", "info": "**unknown (a hang)**",
                "error": "could not run"}[cell.outcome]
        kit = f", kit `{cell.kit}`" if cell.kit else ""
        return f"{said}, {cell.steps} steps" + (f", {met} known failures met" if met else "") + kit

    lines = [f"Profile `{matrix.profile}`, each release's and each adapter's shipped known failures; `kit` is the "
             f"kvconform commit that ran the cell (`+`: with changes not committed).", "",
             "| adapter | " + " | ".join(f"vLLM {v}" for v in releases) + " |",
             "| --- | " + " | ".join("---" for _ in releases) + " |"]
    lines += [f"| `{row}` | " + " | ".join(verdict(cells.get((row, v))) for v in releases) + " |" for row in rows]
    lines += ["", "| adapter | release | behaviours detected | known failure met | times | class | file |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for cell in matrix.cells:
        for entry in (e for e in cell.entries if e.met):
            name = entry.name.replace("|", "&#124;")
            lines.append(f"| `{cell.row}` | {cell.release} | {', '.join(cell.behaviours) or 'none'} | "
                         f"`{name}` | {entry.met} | {entry.entry_class} | `{entry.file}` |")
    return "\n".join(lines) + "\n"


def directive_cli_help(args: list[str], page: str) -> str:
    command = cli_main.commands[args[0]]
    with click.Context(command, info_name=f"kvconform {args[0]}", max_content_width=72) as context:
        return fenced(command.get_help(context), "text")


def directive_plugin_options(args: list[str], page: str) -> str:
    """Return the table of the pytest plugin's options, read from its `pytest_addoption`."""

    class Recorder:
        rows = ["| option | meaning |", "| --- | --- |"]

        def getgroup(self, *args: object) -> Recorder:
            return self

        def addoption(self, name: str, **options: object) -> None:
            self.rows.append(f"| `{name}` | {options.get('help', '')} |")

    recorder = Recorder()
    plugin.pytest_addoption(recorder)
    return "\n".join(recorder.rows) + "\n"


def directive_mutant_catalogue(args: list[str], page: str) -> str:
    """Return the bug catalogue: per mutant, its vLLM reference, the clauses that observe it and the part it
    replaces."""
    from kvconform.conformance.mutants import MUTANTS

    sections = []
    for name, row in MUTANTS.items():
        definition = symbol(f"{row.part.__module__.removeprefix('kvconform.')}.{row.part.__name__}")
        sections.append(f"### `{name}`\n\n**{row.vllm_ref}** · observed by {', '.join(row.clauses)}\n\n"
                        f"{definition.doc}\n\n"
                        + definition_block("quote", f"`{row.part.__name__}`", definition, page))
    return "\n".join(sections)


def import_symbol(name: str) -> type[BaseModel]:
    """Return the object a `module.attribute` path under the kvconform package names."""
    module, _, attr = f"kvconform.{name}".rpartition(".")
    return getattr(importlib.import_module(module), attr)


DIRECTIVES: dict[str, Callable[[list[str], str], str]] = {
    "counterexample": directive_counterexample,
    "example-report": directive_example_report,
    "coverage-line": directive_coverage_line,
    "report-schema": directive_report_schema,
    "scenario-schema": directive_scenario_schema,
    "scenario-library": directive_scenario_library,
    "model": directive_model,
    "source": directive_source,
    "capabilities": directive_capabilities,
    "release-matrix": directive_release_matrix,
    "cli-help": directive_cli_help,
    "plugin-options": directive_plugin_options,
    "mutant-catalogue": directive_mutant_catalogue,
}


def render_directive(match: re.Match[str], page: str) -> str:
    if match["name"] not in DIRECTIVES:
        raise SiteError(f"{page}: unknown directive {match['name']!r}; known: {', '.join(DIRECTIVES)}")
    return DIRECTIVES[match["name"]](match["args"].split(), page)


def expand_directives(markdown: str, page: str) -> str:
    """Return a page for the site: each directive region replaced by what its directive renders."""
    return DIRECTIVE.sub(lambda match: render_directive(match, page) + "\n", markdown)


TIMINGS = re.compile(r'(seconds": |"found_after": |time=")[\d.]+')


def fill_regions(markdown: str, page: str) -> str:
    """Return a page for the repository: each directive region filled with what its directive renders, as plain
    markdown between the directive's line and `<!-- /kvconform -->`; a region that differs only in the example run's
    timings is kept as it is."""
    def fill(match: re.Match[str]) -> str:
        opening = match.group(0).split("\n", 1)[0]
        body = for_repository(render_directive(match, page) + "\n", page)
        if match["body"] is not None and TIMINGS.sub("", match["body"].strip()) == TIMINGS.sub("", body):
            return match.group(0)
        after = "" if match["body"] is not None else "\n"
        return f"{opening}\n\n{body}\n\n{REGION_END}{after}"

    return DIRECTIVE.sub(fill, markdown)


NUMBERED_SOURCE = re.compile(r"^(`{3,})\w+ linenums=\"\d+\"\n.*?^\1\n?", re.MULTILINE | re.DOTALL)
COLLAPSIBLE = re.compile(r'^\?\?\? \w+ "(?P<title>.*)"\n\n(?P<body>(?:(?: {4}.*)?\n)*)', re.MULTILINE)
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
SOURCE_LINE = re.compile(r"^(?:\.\./)*source/(?P<path>.+)\.md#__codelineno-0-(?P<line>\d+)$")


def for_repository(markdown: str, page: str) -> str:
    """Return site markdown as plain markdown that reads well in the repository: collapsed blocks as <details>,
    source listings as the links to the files' lines that precede them (the repository has the files), and links
    to what only the site serves as their text."""
    markdown = NUMBERED_SOURCE.sub("", COLLAPSIBLE.sub(_repository_collapsible, markdown))
    markdown = LINK.sub(lambda m: _repository_link(m["text"], m["target"], page), markdown)
    return re.sub(r"\n{3,}", "\n\n", markdown).strip()


def _repository_collapsible(match: re.Match[str]) -> str:
    """Return a collapsed block as <details>, or, once its source listing is left to the link, as one line."""
    body = NUMBERED_SOURCE.sub("", textwrap.dedent(match["body"])).strip()
    if "```" not in body:
        return f"{match['title']}: {body}\n\n"
    return f"<details><summary>{_html_code(match['title'])}</summary>\n\n{body}\n\n</details>\n\n"


def _html_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _repository_link(text: str, target: str, page: str) -> str:
    if re.match(r"\w+://", target):
        return f"[{text}]({target})"
    here = (DOCS / page).parent
    source = SOURCE_LINE.match(target)
    if source:
        return f"[{text}]({posixpath.relpath(ROOT / source['path'], here)}#L{source['line']})"
    return f"[{text}]({target})" if (here / target.partition("#")[0]).exists() else text


# --- MkDocs events -----------------------------------------------------------------------------


def folder_pages(folder: str) -> list[str]:
    """Return the pages of a docs folder: generated ones in their order, then hand-written ones by name."""
    generated = [page for page in generated_pages() if page.startswith(folder)]
    written = sorted(p.relative_to(DOCS).as_posix() for p in (DOCS / folder).glob("*.md"))
    return generated + written


def _expand_nav(entries: list) -> list:
    expanded = []
    for entry in entries:
        if isinstance(entry, dict):
            entry = {title: _expand_nav(value) if isinstance(value, list) else
                     folder_pages(value) if isinstance(value, str) and value.endswith("/") else value
                     for title, value in entry.items()}
        expanded.append(entry)
    return expanded


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.nav = _expand_nav(config.nav)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for path, markdown in generated_pages().items():
        files.append(File.generated(config, path, content=markdown))
    files.append(File.generated(config, SCHEMA_FILE, content=report_schema()))
    files.append(File.generated(config, SCENARIO_SCHEMA_FILE, content=scenario_schema()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.generated_by is not None:
        return markdown
    return linkify(expand_directives(markdown, page.file.src_uri), page.file.src_uri)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    # Line anchors of code blocks are made after MkDocs collects a page's anchors; add them, so links to
    # source lines are validated like any other anchor.
    page.present_anchor_ids |= set(re.findall(r'id="(__codelineno-[\d-]+)"', html))
    return html


def written_pages() -> list[str]:
    """Return the hand-written pages of the site, docs paths."""
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if not {"hooks", "dev"} & set(p.parts))


if __name__ == "__main__":
    # Rewrite the directive regions of every hand-written page from the code (see the module docstring).
    for written in written_pages():
        path = DOCS / written
        before = path.read_text()
        after = fill_regions(before, written)
        if after != before:
            path.write_text(after)
            print(f"rewrote docs/{written}")
