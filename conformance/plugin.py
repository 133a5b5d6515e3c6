"""The kvconform pytest plugin: `pytest --kv-adapter=NAME|module:factory` runs the conformance suite.

Registered under the `pytest11` entry point, so any project with kvconform installed has the options.
Heavy imports happen only when the suite is requested.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OPTION_ADAPTER = "--kv-adapter"
OPTION_PROFILE = "--kv-profile"
OPTION_SEED = "--kv-seed"
ENV_ADAPTER = "KVCONFORM_ADAPTER"
SUITE = Path(__file__).with_name("suite.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform", "KV connector conformance")
    group.addoption(OPTION_ADAPTER, dest="kv_adapter", default=None,
                    help=f"Adapter to check: registered name or module:factory (or set {ENV_ADAPTER})")
    group.addoption(OPTION_PROFILE, dest="kv_profile", default="ci", help="Hypothesis profile: smoke, ci, dev or thorough")
    group.addoption(OPTION_SEED, dest="kv_seed", type=int, default=None, help="Random seed for the state machine")


def adapter_spec(config: pytest.Config) -> str | None:
    return config.getoption("kv_adapter") or os.environ.get(ENV_ADAPTER)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(id): the spec clause a test checks")
    if adapter_spec(config) is None:
        return
    from kvconform.conformance.profiles import PROFILES

    if config.getoption("kv_profile") not in PROFILES:
        raise pytest.UsageError(f"{OPTION_PROFILE}: unknown profile {config.getoption('kv_profile')!r}; "
                                f"choose one of {', '.join(PROFILES)}")
    if str(SUITE) not in config.args:
        config.args.append(str(SUITE))


def pytest_report_header(config: pytest.Config) -> list[str]:
    spec = adapter_spec(config)
    if spec is None:
        return []
    env = {k: v for k, v in os.environ.items() if k.startswith("KVCONFORM_")}
    return [f"kvconform: adapter {spec}, profile {config.getoption('kv_profile')}, seed {config.getoption('kv_seed')}",
            f"kvconform: environment {env}"]


@pytest.fixture(scope="session")
def kv_adapter_factory(pytestconfig: pytest.Config):
    """The factory of the adapter under test, as chosen by --kv-adapter."""
    from kvconform.adapters.registry import AdapterNotFound, resolve

    spec = adapter_spec(pytestconfig)
    if spec is None:
        raise pytest.UsageError(f"no adapter chosen: pass {OPTION_ADAPTER}=NAME|module:factory or set {ENV_ADAPTER}")
    try:
        return resolve(spec)
    except AdapterNotFound as error:
        raise pytest.UsageError(str(error)) from None
