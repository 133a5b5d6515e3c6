"""The documentation site builds with `mkdocs build --strict`, generated from the spec and the code."""

from __future__ import annotations

import html
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.conformance.report import RunReport
from kvconform.spec import registry

pytestmark = [pytest.mark.docs, pytest.mark.xdist_group("site")]
ROOT = Path(__file__).resolve().parent.parent
CLAUSE_REF = re.compile(r"\b[A-Z]+(?:-[A-Z]+)*-\d+\b")


DOCS_EXTRA = "mkdocs-material is not installed: pip install -e '.[docs]'"


def site_hook():
    """The MkDocs hook module, docs/hooks/kvconform_site.py (it imports MkDocs)."""
    pytest.importorskip("material", reason=DOCS_EXTRA)
    spec = importlib.util.spec_from_file_location("kvconform_site", ROOT / "docs" / "hooks" / "kvconform_site.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once into a temporary folder; any MkDocs warning fails the build (--strict)."""
    pytest.importorskip("material", reason=DOCS_EXTRA)
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    return folder


def page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def chapter(clause: registry.Clause) -> str:
    return f"spec/{clause.chapter.removesuffix('.md')}"


@pytest.mark.parametrize("clause_id", sorted(registry.clauses()))
def test_clause_is_rendered_in_its_chapter(site: Path, clause_id: str) -> None:
    """Each clause: anchor = its ID, heading = ID and title with its requirement badge, listed in the page's table of
    contents as `ID — title`; its realising symbols and its checks, each summed up in whole sentences; its History
    note set apart from the rule."""
    clause = registry.clauses()[clause_id]
    text = page(site, chapter(clause))
    title = html.escape(clause.title, quote=False)
    assert re.search(rf'<h2 id="{clause_id}">{clause_id} — {re.escape(title)} <span class="kv-requirement [^"]+">'
                     rf"{clause.requirement}</span>", text)
    toc_entry = rf'<a href="#{clause_id}" class="md-nav__link">\s*<span class="md-ellipsis">\s*{clause_id} — '
    assert re.search(toc_entry + rf"{re.escape(title)}\s*</span>", text), f"{clause_id}: not in the table of contents"
    section = text.split(f'<h2 id="{clause_id}">', 1)[1].split("<h2 ", 1)[0]
    for name in (*clause.symbols, *clause.checks):
        assert f"<code>{name.split('::')[-1]}</code>" in section, f"{clause_id}: {name} not shown"
    for summary in re.findall(r"<summary>(.*?)</summary>", section, re.DOTALL):
        whole = re.search(r"[.!?]$", summary.strip()) or " — " not in summary
        assert whole, f"{clause_id}: {summary!r} stops mid-phrase"
    if clause.history:
        note = section.split('<p class="admonition-title">History: vLLM releases and issues</p>', 1)[1]
        assert "vLLM" in note.split("</div>", 1)[0], f"{clause_id}: History note not shown"
    else:
        assert "History: vLLM releases" not in section
    judged = "Model-only: not judged against an adapter at run time" if clause.model_only else "Judged at run time"
    assert f'<p class="admonition-title">{judged}</p>' in section, f"{clause_id}: how it is judged is not shown"


def test_clause_index_shows_run_time_coverage(site: Path) -> None:
    """The clause index gives the run-time coverage of the MUST clauses and, per clause, its title and the checks or
    model-only."""
    text = page(site, "spec")
    must = [c for c in registry.clauses().values()
            if c.requirement.startswith("MUST") and c.spec_level in ("connector", "offloading", None)]
    judged = sum(c.id in run_time_clauses() for c in must)
    assert re.search(rf"a run judging both levels</td>\s*<td>{judged} of {len(must)} ", text), "coverage row missing"
    for clause in registry.clauses().values():
        row = text.split(f'>{clause.id}</a>', 1)[1].split("</tr>", 1)[0]
        assert ("model-only" in row) == bool(clause.model_only), f"{clause.id}: {row}"
        assert f"<td>{html.escape(clause.title, quote=False)}</td>" in row, f"{clause.id}: its title is not in its row"


@pytest.mark.parametrize("clause_id", sorted(registry.clauses()))
def test_cited_clauses_are_links(site: Path, clause_id: str) -> None:
    """A clause ID cited in a clause's text links to that clause's anchor."""
    clauses = registry.clauses()
    clause = clauses[clause_id]
    prose = re.sub(r"`[^`]*`", "", clause.text)
    section = page(site, chapter(clause)).split(f'<h2 id="{clause_id}">', 1)[1].split("<h2 ", 1)[0]
    for cited in set(CLAUSE_REF.findall(prose)) & set(clauses):
        target = "" if clauses[cited].chapter == clause.chapter else f"../{clauses[cited].chapter.removesuffix('.md')}/"
        assert f'href="{target}#{cited}"' in section, f"{clause_id} cites {cited} without a link"


def test_spec_version_and_changelog(site: Path) -> None:
    assert f"kvconform spec {registry.spec_version()}" in page(site, "spec/03-connector")
    assert f'<h2 id="{registry.spec_version().replace(".", "")}' in page(site, "spec/changelog")


def test_report_schema_is_published(site: Path) -> None:
    """The reports page shows the RunReport schema and the site serves it as report.schema.json."""
    published = json.loads((site / "report.schema.json").read_text())
    assert {k: v for k, v in published.items() if k != "$schema"} == RunReport.model_json_schema()
    html = page(site, "reports")
    assert "report.schema.json" in html and "known_failures" in html and "checked_at_run_time" in html
    assert "model_only" in html and "MUST clauses judged at run time" in html


def test_scenario_schema_is_published(site: Path) -> None:
    """The scenarios page shows the scenario file schema and the site serves it as scenario.schema.json."""
    from kvconform.conformance.scenarios import ScenarioFile

    published = json.loads((site / "scenario.schema.json").read_text())
    assert {k: v for k, v in published.items() if k != "$schema"} == ScenarioFile.model_json_schema()
    assert "scenario.schema.json" in page(site, "scenarios")


def test_adapter_pages_are_in_the_nav(site: Path) -> None:
    """Every page in docs/adapters/ is built and listed in the navigation, the reference with its capabilities."""
    home = page(site, "")
    for written in (ROOT / "docs" / "adapters").glob("*.md"):
        assert (site / "adapters" / written.stem / "index.html").is_file()
        assert f'href="adapters/{written.stem}/"' in home, f"{written.name} is not in the nav"
    assert "<code>async_scheduling</code>" in page(site, "adapters/reference")


def test_adapter_authors_page_shows_a_real_counterexample(site: Path) -> None:
    html = page(site, "adapter-authors")
    assert "NOT conformant: OFF-READ-1" in html and "adapter.add_request(RequestSpec(" in html


def test_bug_catalogue_lists_every_mutant(site: Path) -> None:
    """The catalogue page shows each mutant with its vLLM reference, its clauses as links and its replaced part."""
    from kvconform.conformance.mutants import MUTANTS

    html = page(site, "mutants")
    for name, row in MUTANTS.items():
        assert f'id="{name}"' in html and row.part.__name__ in html, name
        for clause in row.clauses:
            assert f'#{clause}">{clause}</a>' in html, (name, clause)


def test_home_page_is_the_readme_with_the_site_map_first(site: Path) -> None:
    """The home page renders the README: one title, the site map as its first section, every README section a
    heading in the table of contents, and no paragraph line turned into a heading."""
    text = page(site, "")
    content = text.split('<article class="md-content__inner md-typeset">', 1)[1].split("</article>", 1)[0]
    assert len(re.findall(r"<h1[ >]", content)) == 1
    readme_sections = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    headings = [re.sub(r"<[^>]+>|¶", "", html.unescape(h)).strip()
                for h in re.findall(r"<h2[^>]*>(.*?)</h2>", content, re.DOTALL)]
    assert headings == [re.sub(r"`", "", s) for s in readme_sections], headings
    assert headings[0] == "Documentation", "the site map is not the home page's first section"
    for target in ("adapter-authors/", "scenarios/", "reports/", "campaigns/", "mutants/", "adapters/reference/",
                   "spec/00-overview/"):
        assert f'href="{target}"' in content.split("<h2", 2)[1], f"the site map does not link {target}"


def test_code_blocks_wrap_within_the_page(site: Path) -> None:
    """Code blocks without line numbers wrap at the page width; the README's are of that kind."""
    css = (site / "stylesheets" / "kvconform.css").read_text()
    rule = re.search(r"\.md-typeset \.highlight > pre > code \{([^}]*)\}", css)
    assert rule and "white-space: pre-wrap" in rule[1]
    assert '<div class="language-text highlight"><pre>' in page(site, "")


def test_repository_pages_have_no_holes():
    """A page read in the repository shows what the site shows: every directive opens a region filled with the
    directive's content, and that content is current (`python docs/hooks/kvconform_site.py` rewrites it)."""
    hook = site_hook()
    for written in hook.written_pages():
        markdown = (ROOT / "docs" / written).read_text()
        for match in hook.DIRECTIVE.finditer(markdown):
            assert match["body"] is not None, f"docs/{written}: {match.group(0).strip()} is a hole: run {hook.__file__}"
        current = hook.fill_regions(markdown, written)
        assert current == markdown, f"docs/{written} is out of date: run python {hook.__file__}"


def test_lab_notes_are_not_on_the_site(site: Path) -> None:
    """Developer notes (docs/dev/) stay in the repository, off the site and its navigation."""
    assert (ROOT / "docs" / "dev" / "vllm-driving-notes.md").is_file()
    assert not (site / "dev").exists()
    assert "vllm-driving" not in page(site, "")


def test_release_matrix_names_each_cells_kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The release matrix renders each cell's verdict with the kvconform commit that ran it, where the cell has one."""
    from kvconform.releases import MatrixCell, ReleaseMatrix

    hook = site_hook()
    matrix = ReleaseMatrix(cells=[MatrixCell(row="vllm-offloading", release="0.28.0", outcome="ok", steps=1335,
                                             kit="0123456789+"),
                                  MatrixCell(row="vllm-offloading", release="0.30.0", outcome="ok", steps=1123)])
    (tmp_path / "release-matrix.json").write_text(matrix.model_dump_json())
    monkeypatch.setattr(hook, "DOCS", tmp_path)
    table = hook.directive_release_matrix([], "adapters/vllm-releases.md")
    assert "| `vllm-offloading` | conformant, 1335 steps, kit `0123456789+` | conformant, 1123 steps |" in table
