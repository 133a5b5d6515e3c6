"""Past a known failure the example goes on (CONF-RUN-2): the reference takes the implementation's own lookups,
offers or eviction victims where the run lists their clause, and every other clause is still judged."""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.vllm import runtime
from kvconform.cli import main
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.conformance import baseline, options, runner
from kvconform.conformance.baseline import Baseline, Entry
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.mutants import MUTANTS
from kvconform.reference.connector import OffloadConnectorScheduler
from kvconform.reference.engine import Engine


class CappedLookupConnector(OffloadConnectorScheduler):
    """Looks the store up only to the request's last token but one, as vLLM's SimpleCPUOffloadConnector caps its hit
    (`max_hit_len`): a full last block is never looked up (a known OFF-LOOKUP-1 deviation of that connector)."""

    def _lookup(self, state, lookup_end=None):
        request = state.request
        capped = (request.num_tokens - 1) // self.offloaded_block_size
        return super()._lookup(state, capped if lookup_end is None else min(lookup_end, capped))


def capped_lookup_adapter() -> ReferenceAdapter:
    return ReferenceAdapter(engine=functools.partial(Engine, connector=CappedLookupConnector))


def run(adapter, known: dict[str, str]) -> runner.RunResult:
    listed = [Entry(clause, reason, rare=True) for clause, reason in known.items()]
    return runner.run(adapter, "deviating", profile="ci", baseline=Baseline(listed))


@pytest.mark.long
@pytest.mark.parametrize(("adapter", "clauses"), [
    (MUTANTS["lru-touch-ignored"].adapter, ("OFF-LRU-1",)),
    # The capped lookup never sees a last block still being stored, so it answers where it must defer: OFF-LOOKUP-3.
    (capped_lookup_adapter, ("OFF-LOOKUP-1", "OFF-LOOKUP-3")),
    (MUTANTS["decoded-blocks-not-offloaded"].adapter, ("OFF-STORE-1", "OFF-READ-3")),
])
def test_a_known_deviation_is_followed_and_the_example_goes_on(adapter, clauses):
    """Each deviation fails its clauses when they are not listed; listed, the run passes, records them as known
    failures, and judges steps after them."""
    assert run(adapter, {}).failed_clause in clauses
    listed = run(adapter, dict.fromkeys(clauses, "the implementation's own choice"))
    assert listed.passed and set(listed.known_failures) <= set(clauses), listed.message
    assert listed.statistics.steps_after_known_failure > 0


def test_a_followed_offer_still_fails_the_skip_read_rule():
    """Offers are followed where OFF-STORE-1 is listed, but a skip-read request that offers less than it must breaks
    OFF-READ-3, which the run does not list: the seed rule's second half is still judged."""
    result = run(MUTANTS["skip-returns-early"].adapter, {"OFF-STORE-1": "offers a step late"})
    assert result.failed_clause == "OFF-READ-3", result.message


def test_a_victim_the_store_must_keep_is_not_followed():
    """An eviction of a block a load still reads is not a victim the reference takes: listing the policy's clauses
    does not hide OFF-MGR-3."""
    known = {"OFF-LRU-1": "another order", "OFF-ARC-1": "another order"}
    assert run(MUTANTS["evicts-pinned"].adapter, known).failed_clause == "OFF-MGR-3"


# --- entries that name their cause ------------------------------------------------------------------------

SEED = MUTANTS["skip-flag-ignored"].adapter
"""Breaks OFF-READ-1, the seed rule: a skip-read request is looked up ("skips reading cached KV but the store was
looked up for offloaded blocks ...")."""


def test_a_failure_of_a_listed_clause_for_no_listed_cause_fails_the_run(tmp_path: Path) -> None:
    """CONF-RUN-2: OFF-READ-1 listed only for another cause (a pattern its message does not hold) is not known: the
    run fails on it and says which causes are listed; with the cause its message holds, the run passes and the report
    counts how often each entry was met (an entry never met and not rare would be stale)."""
    path = tmp_path / "known.txt"
    path.write_text("OFF-READ-1 [rare] /looked up twice/: another cause\n")
    other = runner.run(SEED, "skip-flag-ignored", "smoke", baseline=baseline.load(path))
    assert other.failed_clause == "OFF-READ-1", other.message
    assert "list OFF-READ-1 for another cause only: OFF-READ-1 /looked up twice/" in other.message, other.message
    path.write_text("OFF-READ-1 [rare] /looked up twice/: another cause\n"
                    "OFF-READ-1 /skips reading cached KV but the store was looked up/: the seed bug\n")
    known = runner.run(SEED, "skip-flag-ignored", "smoke", baseline=baseline.load(path))
    assert known.passed, known.message
    met = known.known_failures_met
    assert met["OFF-READ-1 /looked up twice/"] == 0 and met["OFF-READ-1 /skips reading cached KV but the store was "
                                                               "looked up/"] > 0, met


def test_an_entry_without_a_cause_stands_for_any_failure_of_its_clause() -> None:
    listed = Baseline([Entry("OFF-READ-1", "any"), Entry("OFF-LRU-1", "told", cause=re.compile("victim"))])
    assert listed.tolerates(ClauseViolation("OFF-READ-1", "whatever it says"))
    assert not listed.tolerates(ClauseViolation("OFF-LRU-1", "another order"))
    assert listed.tolerates(ClauseViolation("OFF-LRU-1", "evicted another victim"))
    assert listed.met == {"OFF-READ-1": 1, "OFF-LRU-1 /victim/": 1}


@pytest.mark.parametrize(("text", "words"), [
    ("OFF-READ-1 /(unclosed/: reason\n", "the cause /(unclosed/ is not a regular expression"),
    ("OFF-READ-1 /a/: one\nOFF-READ-1 /a/: two\n", "OFF-READ-1 /a/ is listed twice"),
    ("OFF-READ-1 [rare] a/: reason\n", "expected 'CLAUSE-ID: reason'"),
    ("NOPE-1 /a/: reason\n", "NOPE-1 is not a clause"),
])
def test_a_malformed_cause_is_one_line_exit_2(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "known.txt"
    path.write_text(text)
    result = CliRunner().invoke(main, ["run", "--adapter", "reference", "--known-failures", str(path)])
    assert result.exit_code == 2 and words in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_every_shipped_file_parses_and_its_causes_are_patterns() -> None:
    """Every shipped file loads (known clauses, valid causes); each release file lists the scheduler's deviations
    of that release only (SCHED-*, or the connector-level form of one: KVC-LIVE-1)."""
    folder = resources.files("kvconform.adapters.vllm").joinpath("known-failures")
    for path in folder.iterdir():
        listed = baseline.load(path).listed
        if re.fullmatch(r"vllm-\d+\.\d+\.\d+\.txt", path.name):
            assert {entry.clause.split("-")[0] for entry in listed} <= {"SCHED", "KVC"}, path.name


def test_a_release_without_a_shipped_file_is_a_warning_the_banner_names_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter package that ships known failures per release: a run on a release it ships a file for names that
    file (before the user's) in its banner; on one it ships none for, a warning line says so."""
    package = tmp_path / "shipping_adapter"
    (package / "known-failures").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import os\nfrom kvconform.adapters.reference import ReferenceAdapter\n"
        "class Adapter(ReferenceAdapter):\n"
        "    def implementation_version(self):\n        return 'engine ' + os.environ['ENGINE_VERSION']\n")
    (package / "known-failures" / "engine-1.0.txt").write_text("# nothing known\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user = tmp_path / "mine.txt"
    user.write_text("OFF-READ-1 [rare]: mine\n")
    for version, line in (("1.0", f"kvconform: engine 1.0: behaviours detected: none; known failures: "
                                   f"{package / 'known-failures' / 'engine-1.0.txt'}, {user}"),
                          ("2.0", "kvconform: warning: engine 2.0 has no verdict table in kvconform")):
        monkeypatch.setenv("ENGINE_VERSION", version)
        result = CliRunner().invoke(main, ["run", "--adapter", "shipping_adapter:Adapter", "--profile", "smoke",
                                           "--known-failures", str(user), "--database", "none"])
        assert result.exit_code == 0 and line in result.stderr.replace("\n", " "), result.stderr


@pytest.mark.vllm
@pytest.mark.skipif(runtime.installed_version() != "0.23.0",
                    reason="needs vLLM 0.23.0 (its own environment): kvconform install-vllm 0.23.0")
def test_a_scheduler_deviation_is_listed_once_for_every_adapter_on_its_release() -> None:
    """CONF-RUN-2: 0.23's scheduler race (SCHED-ALLOC-1), listed once in the release's file, is met as listed by a
    run of vllm-offloading, whose own file does not list it; without the release's file the program fails it."""
    from kvconform.adapters.vllm.offloading import VllmOffloadingAdapter

    folder = resources.files("kvconform.adapters.vllm")
    text = folder.joinpath("deviations", "vllm-offloading-0.23.0-SCHED-ALLOC-1.json").read_text(encoding="utf-8")
    program = [Call.from_json(operation) for operation in json.loads(text)["program"]]
    own = folder.joinpath("known-failures", "vllm-offloading-0.23.0.txt")
    alone = replay(Session(VllmOffloadingAdapter, baseline=baseline.load(own)), program).violation
    assert alone is not None and alone.clause == "SCHED-ALLOC-1", alone
    run = options.prepare("vllm-offloading", known_failures_path=Path(str(own)), database="none")
    assert run.known_failures_files[0].endswith("vllm-0.23.0.txt") and "SCHED-ALLOC-1" in run.known_failures
    listed = baseline.Baseline(list(run.known_entries))
    assert replay(Session(VllmOffloadingAdapter, baseline=listed), program).violation is None
    assert listed.met == {"SCHED-ALLOC-1 /for which the free blocks do not hold/": 1}, listed.met


class OffersUncomputedAtFinishConnector(OffloadConnectorScheduler):
    """Offers a finished request's blocks up to its last token, whose KV was never computed, as vLLM 0.28 does
    (offloading/scheduler.py:1265-1266): an offer the reference declines to follow (OFF-STORE-1)."""

    def _store_candidates(self, output):
        for state, num_offloadable, block_ids in super()._store_candidates(output):
            if state.finished:
                num_offloadable = min(state.request.num_tokens, len(state.block_ids) * self.block_size)
            yield state, num_offloadable, block_ids


class OffersUncomputedAtFinishAdapter(ReferenceAdapter):
    def __init__(self, device=None):
        super().__init__(device, engine=functools.partial(Engine, connector=OffersUncomputedAtFinishConnector))

    def capabilities(self):
        return super().capabilities().model_copy(update={"offer_at_finish": (True,)})


def test_a_victim_after_a_declined_offer_of_uncomputed_blocks_names_that_offer():
    """The reference does not follow an offer of uncomputed blocks: the stores differ from then on, and a victim the
    engine evicts otherwise says so, so that an entry can list it as that offer's consequence (0.28.0's ci run:
    r9's uncomputed block 0 touches r3's equal block in ARC, and r10's offer evicts another block)."""
    config = EngineConfig(block_size_factor=1, num_offload_blocks=12, eviction_policy="arc", offer_at_finish=True)
    program = [Call("start", (config,)), Call("add_request", (RequestSpec(request_id="r3", prompt=(2,) * 44),)),
               Call("add_request", (RequestSpec(request_id="r9", prompt=(2, 2), max_tokens=2),)),
               Call("add_request", (RequestSpec(request_id="r10", prompt=(2, 2, 1, 2, 2, 0, 0), max_tokens=2),)),
               Call("drain")]
    offered = replay(Session(OffersUncomputedAtFinishAdapter), program).violation
    assert offered is not None and offered.clause == "OFF-STORE-1" and "offered at finish: r9" in offered.detail
    listed = Baseline([Entry("OFF-STORE-1", "bug", cause=re.compile("offered at finish")),
                       Entry("OFF-LRU-1", "design", rare=True)])
    victim = replay(Session(OffersUncomputedAtFinishAdapter, baseline=listed), program).violation
    assert victim is not None and victim.clause == "OFF-ARC-1", victim
    assert victim.detail.endswith("(the store differing since the offer of uncomputed blocks)"), victim.detail
