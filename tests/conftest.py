"""The kit's own test run as a contributor meets it: on every core, the long tier left to CI, and a summary that
says what was left out and the one command that brings it back."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest

from kvconform.conformance import options

LONG_TIER = "long"
OPTION_LONG = "--long"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION_LONG, action="store_true", help="Also run the long tier (tests marked `long`), as CI does")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Spread the tests over every core (`-n auto`) when pytest-xdist is installed and `-n` was not given; never
    in an xdist worker, which would start workers of its own. Tests of one `xdist_group` share a worker (the
    documentation site is built once)."""
    worker = hasattr(config, "workerinput")
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None and not worker:
        config.option.numprocesses = "auto"
        config.option.dist = "loadgroup"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the long tier unless --long asks for it."""
    if config.getoption(OPTION_LONG):
        return
    skip = pytest.mark.skip(reason=f"the long tier, run by CI: python -m pytest {OPTION_LONG}")
    for item in items:
        if LONG_TIER in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which tests did not run and why, grouped by reason; each reason ends with the command that enables it."""
    reasons = Counter(_reason(report) for report in terminalreporter.stats.get("skipped", []))
    if not reasons:
        return
    terminalreporter.section("not run")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count} skipped: {reason}")


def _reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


@pytest.fixture
def connector_environment() -> Iterator[None]:
    """Start without a connector named, and forget whatever the test named: `--connector` sets the environment."""
    saved = {variable: os.environ.pop(variable, None) for variable in options.CONNECTOR_VARIABLES}
    yield
    for variable, value in saved.items():
        os.environ.pop(variable, None)
        if value is not None:
            os.environ[variable] = value
