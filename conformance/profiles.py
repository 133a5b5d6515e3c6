"""Hypothesis settings profiles: `smoke` (derandomised, seconds), `ci` (derandomised, short), `dev`, `thorough`."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

PROFILES = {
    "smoke": dict(max_examples=30, stateful_step_count=30, derandomize=True),
    "ci": dict(max_examples=300, stateful_step_count=50, derandomize=True),
    "dev": dict(max_examples=200, stateful_step_count=40),
    "thorough": dict(max_examples=1000, stateful_step_count=80),
}
DEFAULT_PROFILE = "ci"


def profile_settings(name: str, seed_given: bool = False) -> settings:
    """Return the settings of profile `name`; an explicit seed turns derandomisation off."""
    if name not in PROFILES:
        raise KeyError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
    values = dict(PROFILES[name])
    if seed_given:
        values["derandomize"] = False
    return settings(deadline=None, database=None, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), **values)
