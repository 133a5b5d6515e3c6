"""Layering: the oracle depends on nothing it judges (issue 15, item 5), read from the source files with `ast`.

`common/` (the contract's values, the KV content function) is the neutral ground every side imports; the reference
imports no adapter or kit code, so a bug there cannot leak into the oracle; and the vLLM adapters move their bytes with
code of their own, not the reference's, so a bug in either byte path shows in the byte checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NEUTRAL_ADAPTER_MODULES = ("contract.py", "registry.py", "pair.py")
"""What adapters/ holds besides the adapters: the contract, the registry that names them, the glue of a pair."""

CONCRETE_ADAPTERS = tuple(sorted(
    "kvconform.adapters." + ".".join(path.relative_to(ROOT / "adapters").with_suffix("").parts)
    for path in (ROOT / "adapters").iterdir() if path.name not in ("__init__.py", *NEUTRAL_ADAPTER_MODULES)
    and (path.suffix == ".py" or path.is_dir()) and not path.name.startswith(("_", "."))))
"""The adapters themselves: every module under adapters/ but the neutral ones (`NEUTRAL_ADAPTER_MODULES`)."""

FORBIDDEN_IMPORTS = {
    "common": ("kvconform.adapters", "kvconform.conformance", "kvconform.reference"),
    "reference": ("kvconform.adapters", "kvconform.conformance"),
    "adapters/vllm": ("kvconform.reference", "kvconform.conformance"),
    "adapters/pair.py": ("kvconform.reference", "kvconform.conformance", *CONCRETE_ADAPTERS),
    "conformance": CONCRETE_ADAPTERS,
}
"""Folder of the tree → the packages no module under it may import, at any depth of its code. The kit judges an
adapter through the contract alone, against the spec's model (`kvconform.reference`), never against an adapter."""

EXEMPT = {"conformance/mutants": "the mutant catalogue: adapters built from the reference adapter, one bug each"}
"""Folders inside a layer that the layer's rule does not bind, and why."""


def package_of(path: Path) -> str:
    """Return the package a source file belongs to: each top-level folder is installed as `kvconform.<folder>`, but the
    shell's, `kvconform/`, which is the package `kvconform` itself."""
    parts = path.parent.relative_to(ROOT).parts
    return ".".join(("kvconform", *(parts[1:] if parts[:1] == ("kvconform",) else parts)))


def imported_modules(source: str, package: str) -> set[str]:
    """Return every module `source` imports, absolute, anywhere in its code: `from a import b` imports `a` and `a.b`."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*anchor, *([node.module] if node.module else [])])
            modules.add(module)
            modules.update(f"{module}.{alias.name}" for alias in node.names)
    return modules


def forbidden(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """Return the modules that are one of `packages` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


@pytest.mark.parametrize("folder", sorted(FORBIDDEN_IMPORTS))
def test_layer_imports_nothing_it_must_not(folder: str) -> None:
    packages = FORBIDDEN_IMPORTS[folder]
    sources = sorted(path for path in ((ROOT / folder).rglob("*.py") if (ROOT / folder).is_dir() else [ROOT / folder])
                     if not any(path.is_relative_to(ROOT / exempt) for exempt in EXEMPT))
    assert sources, f"{folder}/ has no Python sources"
    for path in sources:
        found = forbidden(imported_modules(path.read_text(encoding="utf-8"), package_of(path)), packages)
        assert not found, f"{path.relative_to(ROOT)} imports {', '.join(found)}; {folder}/ may import none of them"


def test_the_contract_is_imported_for_what_it_defines() -> None:
    """adapters/contract.py owns the adapter ABC and ImplementationFailure; the values it uses are imported from
    `kvconform.common.values`, never through it."""
    contract = ast.parse((ROOT / "adapters" / "contract.py").read_text(encoding="utf-8"))
    defined = {node.name for node in contract.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    for path in sorted(p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.parts)):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "kvconform.adapters.contract":
                borrowed = sorted(alias.name for alias in node.names if alias.name not in defined)
                assert not borrowed, (f"{path.relative_to(ROOT)} imports {borrowed} from adapters.contract, which "
                                      "only uses them: import them from kvconform.common.values")


@pytest.mark.parametrize("source", [
    "from kvconform.adapters.contract import EngineConfig",
    "import kvconform.adapters.contract",
    "from kvconform import adapters",
    "def build():\n    from kvconform.adapters import registry\n",
    "from ..adapters import contract",
])
def test_every_form_of_a_forbidden_import_is_found(source: str) -> None:
    """The scan sees absolute, package-relative and function-level imports, whichever way they are written."""
    assert forbidden(imported_modules(source, "kvconform.reference"), FORBIDDEN_IMPORTS["reference"])


def test_the_kit_may_not_import_the_reference_adapter() -> None:
    """The offloading level's judge follows an injected reference engine, not the reference adapter: conformance/
    may import the spec's model and the adapter contract, no adapter."""
    assert "kvconform.adapters.reference" in CONCRETE_ADAPTERS and "kvconform.adapters.vllm" in CONCRETE_ADAPTERS
    assert forbidden(imported_modules("from kvconform.adapters.reference import ReferenceAdapter",
                                      "kvconform.conformance"), FORBIDDEN_IMPORTS["conformance"])
    assert not forbidden(imported_modules("from kvconform.adapters.contract import KVConnectorAdapter\n"
                                          "from kvconform.adapters.registry import resolve\n"
                                          "from kvconform.reference.engine import Engine", "kvconform.conformance"),
                         FORBIDDEN_IMPORTS["conformance"])


def test_a_neighbour_of_a_forbidden_package_is_allowed() -> None:
    assert not forbidden(imported_modules("import kvconform.adapters_extra", "kvconform.reference"),
                         FORBIDDEN_IMPORTS["reference"])


LIBRARY = ("spec", "common", "reference", "conformance", "adapters", "benchmarks")
"""The library's folders: everything but the shell, `kvconform/` (the CLI and the pytest plugin)."""

SHELL = tuple(sorted(f"kvconform.{path.stem}" for path in (ROOT / "kvconform").glob("*.py") if path.stem != "__init__"))


def module_of(path: Path) -> str:
    """Return the module a source file installs as."""
    package = package_of(path)
    return package if path.name == "__init__.py" else f"{package}.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    """Return each module of the project -> the project's modules it imports, anywhere in its code."""
    paths = {module_of(path): path for folder in (*LIBRARY, "kvconform") for path in (ROOT / folder).rglob("*.py")}
    return {module: imported_modules(path.read_text(encoding="utf-8"), package_of(path)) & paths.keys() - {module}
            for module, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan's algorithm): each an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    """No import circle anywhere in the package, function-level and TYPE_CHECKING imports included (issue 35)."""
    assert not circles(import_graph())


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_the_shell() -> None:
    """Nothing of the library imports `kvconform/`: its CLI and pytest plugin, or the package root (issue 35)."""
    assert "kvconform.cli" in SHELL and "kvconform.plugin" in SHELL
    for module, imported in import_graph().items():
        if module.split(".")[1:2] and module.split(".")[1] in LIBRARY:
            upward = sorted(m for m in imported if m == "kvconform" or forbidden({m}, SHELL))
            assert not upward, f"{module} imports the shell: {', '.join(upward)}"


@pytest.mark.parametrize("adapter", CONCRETE_ADAPTERS)
def test_no_adapter_imports_another_adapter(adapter: str) -> None:
    """An adapter is built on the contract and the neutral modules of adapters/ (a pair's on `adapters/pair.py`), never
    on another adapter (issue 35)."""
    folder = ROOT.joinpath("adapters", *adapter.split(".")[2:])
    sources = sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    others = tuple(other for other in CONCRETE_ADAPTERS if other != adapter)
    for path in sources:
        found = forbidden(imported_modules(path.read_text(encoding="utf-8"), package_of(path)), others)
        assert not found, f"{path.relative_to(ROOT)} imports the adapter(s) {', '.join(found)}"
