"""Run profiles: `smoke` (derandomised, seconds), `ci` (derandomised, short), `dev`, `thorough` (long runs).

Hypothesis generates the programs; it does not shrink them: the kit's own shrinker does, within the
profile's shrink budget (CONF-RUN-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings


@dataclass(frozen=True)
class Profile:
    max_examples: int
    stateful_step_count: int
    shrink_seconds: float
    derandomize: bool = False


PROFILES = {
    "smoke": Profile(max_examples=30, stateful_step_count=30, shrink_seconds=10, derandomize=True),
    "ci": Profile(max_examples=300, stateful_step_count=50, shrink_seconds=20, derandomize=True),
    "dev": Profile(max_examples=300, stateful_step_count=50, shrink_seconds=30),
    "thorough": Profile(max_examples=1000, stateful_step_count=80, shrink_seconds=120),
}
DEFAULT_PROFILE = "ci"


def profile_settings(name: str, seed_given: bool = False) -> settings:
    """Return the Hypothesis settings of profile `name`; an explicit seed turns derandomisation off."""
    profile = PROFILES[name]
    return settings(deadline=None, database=None, report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.reuse, Phase.generate), max_examples=profile.max_examples,
                    stateful_step_count=profile.stateful_step_count,
                    derandomize=profile.derandomize and not seed_given)
