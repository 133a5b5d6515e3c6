"""Runs of the kit's own pytest suites in a pytest process of their own (`docs/campaigns.md`): a campaign across
workers (`kvconform run --workers`), and the benchmarks of one."""

from __future__ import annotations

from pathlib import Path


def isolated(folder: Path) -> list[str]:
    """Return the pytest arguments that run a kit suite from `folder`, away from the configuration and conftest files
    of the current directory, which are the user's project's."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    return ["-c", str(folder / "pytest.ini"), "--rootdir", str(folder), "-p", "no:cacheprovider"]
