"""Run profiles: `smoke` (derandomised, seconds), `ci` (derandomised, short), `dev`, `thorough` (long runs).

Hypothesis generates the programs; it does not shrink them: the kit's own shrinker does, within the
profile's shrink budget (CONF-RUN-3).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import providers


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


@contextmanager
def programs_from_seed_alone() -> Iterator[None]:
    """Draw programs from the profile and seed alone, not from the modules the process has imported (CONF-RUN-4).

    Hypothesis mixes constants found in the source of every local module loaded into what it draws, so the
    same seed would draw other programs after one more import. Its cache of those constants is emptied on
    the way in and out, so that tests run after the kit see their own constants again.
    """
    if not hasattr(providers, "_get_local_constants"):  # releases before local constants: nothing to turn off
        yield
        return
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        with mock.patch.object(providers, "_get_local_constants", providers.Constants):
            yield
    finally:
        providers.CONSTANTS_CACHE.cache.clear()
