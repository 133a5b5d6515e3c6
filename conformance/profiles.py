"""Run profiles: `smoke` (derandomised, seconds), `ci` (derandomised, short), `dev`, `thorough` (long runs).

Hypothesis generates the programs; it does not shrink them: the kit's own shrinker does, within the
profile's shrink budget (CONF-RUN-3).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

if TYPE_CHECKING:  # Hypothesis is imported when a run needs it, not when the pytest plugin loads this table
    from hypothesis import settings
    from hypothesis.database import ExampleDatabase


@dataclass(frozen=True)
class Profile:
    max_examples: int
    stateful_step_count: int
    shrink_attempts: int
    """Replays of edited programs the shrinker may try: a count, not seconds, so that how small a counterexample gets
    does not depend on the machine's load (CONF-RUN-3)."""
    derandomize: bool = False


PROFILES = {
    "smoke": Profile(max_examples=30, stateful_step_count=30, shrink_attempts=500, derandomize=True),
    "ci": Profile(max_examples=400, stateful_step_count=50, shrink_attempts=1000, derandomize=True),
    "dev": Profile(max_examples=300, stateful_step_count=50, shrink_attempts=1000),
    "thorough": Profile(max_examples=1000, stateful_step_count=80, shrink_attempts=3000),
}
"""ci: 400 examples, the budget at which its fixed programs draw every situation of the exercise table in both
scheduling modes on the reference and kill every catalogue mutant by a clause its row names; at 300, transfers
completed inside a step, failed loads or aborts during a load went undrawn in one mode or the other, whichever way
the rules were arranged (issue 25, item 8).

Shrink attempts: every catalogue mutant's ci counterexample reaches its smallest form within 720 replays (measured
with no limit: 19 – 719), in 0.1 – 43 s on a busy 2-core machine; a vLLM adapter replays a short program in 0.1 s."""
DEFAULT_PROFILE = "ci"


@dataclass(frozen=True)
class Shard:
    """One of `count` parts of a run split across workers: its own seed and its share of the examples (CONF-RUN-4).

    The parts of a run draw different programs, each from its own seed, stable across reruns.
    """

    index: int = 0
    count: int = 1

    def examples(self, total: int) -> int:
        """Return this part's share of `total` examples; the parts' shares add up to `total`."""
        return total // self.count + (self.index < total % self.count)

    def seed(self, base: int | None) -> int | None:
        """Return the seed this part draws from, given the run's: the run's own when the run is not split."""
        if self.count == 1:
            return base
        if base is None:
            raise ValueError("a run split across workers needs a seed to derive each part's seed from")
        return base * self.count + self.index

    def trace(self, path: Path) -> Path:
        """Return where this part writes the trace of a run recorded at `path`: a file per part of a split run, which
        `kvconform check` judges together (`name.part-1-of-2.jsonl`, …)."""
        return path if self.count == 1 else path.with_name(f"{path.stem}.part-{self.index + 1}-of-{self.count}"
                                                           f"{path.suffix}")


def profile_settings(name: str, seed_given: bool = False, database: ExampleDatabase | None = None,
                     max_examples: int | None = None) -> settings:
    """Return the Hypothesis settings of profile `name`; an explicit seed turns derandomisation off.

    A derandomised run neither reads nor writes `database`: it draws the same programs every time (CONF-RUN-5).
    `max_examples` replaces the profile's for one shard of a run split across workers.
    """
    from hypothesis import HealthCheck, Phase, settings

    profile = PROFILES[name]
    derandomize = profile.derandomize and not seed_given
    return settings(deadline=None, database=None if derandomize else database, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    max_examples=profile.max_examples if max_examples is None else max_examples,
                    stateful_step_count=profile.stateful_step_count, derandomize=derandomize)


@contextmanager
def programs_from_seed_alone() -> Iterator[None]:
    """Draw programs from the profile and seed alone, not from the modules the process has imported (CONF-RUN-4).

    Hypothesis mixes constants found in the source of every local module loaded into what it draws, so the
    same seed would draw other programs after one more import. Its cache of those constants is emptied on
    the way in and out, so that tests run after the kit see their own constants again.
    """
    # Private: no public setting turns off Hypothesis's local constants (6.170).
    from hypothesis.internal.conjecture import providers

    if not (hasattr(providers, "_get_local_constants") and hasattr(providers, "CONSTANTS_CACHE")):
        # A release without these internals: one before local constants, or one that renamed them, which
        # test_programs_do_not_depend_on_imports then catches.
        yield
        return
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        with mock.patch.object(providers, "_get_local_constants", providers.Constants):
            yield
    finally:
        providers.CONSTANTS_CACHE.cache.clear()
