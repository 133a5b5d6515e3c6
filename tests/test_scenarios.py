"""Scenarios as connector authors write them (issue 14): the builder, the JSON form, and their diffs."""

import json
import re

import pytest

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import EngineConfig
from kvconform.conformance import vectors
from kvconform.conformance.checks import ClauseViolation
from kvconform.conformance.vectors import Scenario

CONFIG = EngineConfig(block_size=4, block_size_factor=3, num_gpu_blocks=100, num_offload_blocks=8,
                      async_scheduling=False)
BLOCK = [0] * 12


def skip_read_scenario(stored_after_skip: list) -> Scenario:
    """vLLM PR #44592's seed: fill the store, reset the prefix cache, resend with the skip flag (OFF-READ-3)."""
    return (Scenario(CONFIG, clause="OFF-READ-3")
            .add("fill", BLOCK).step(stores=[{"request_id": "fill", "offload_indices": [0], "evicted": []}])
            .complete_transfers().step(stored=[("fill", (0,))]).step()
            .reset_prefix_cache()
            .add("skip", BLOCK, skip_reading_prefix_cache=True).step(looked_up=False, loads=[], stores=stored_after_skip))


def test_a_builder_scenario_passes_on_the_reference():
    skip_read_scenario(stored_after_skip=[]).run(ReferenceAdapter())


def test_a_wrong_expectation_fails_with_a_per_step_diff():
    wrong = [{"request_id": "skip", "offload_indices": [0], "evicted": []}]
    with pytest.raises(ClauseViolation) as raised:
        skip_read_scenario(stored_after_skip=wrong).run(ReferenceAdapter())
    assert raised.value.clause == "OFF-READ-3"
    assert "stores:\n    - expected [{'request_id': 'skip'" in raised.value.detail
    assert "\n    + observed []" in raised.value.detail


def test_the_json_form_round_trips_and_replays(tmp_path):
    path = tmp_path / "my-scenario.json"
    path.write_text(json.dumps(skip_read_scenario(stored_after_skip=[]).vector().to_json()))
    vectors.replay(vectors.load_file(path), ReferenceAdapter())


def test_a_scenario_needing_a_level_the_adapter_lacks_is_refused():
    class ConnectorOnly(ReferenceAdapter):
        def capabilities(self):
            return super().capabilities().model_copy(update={"levels": ("connector",)})

    with pytest.raises(vectors.Unsupported):
        Scenario(CONFIG, level="offloading").add("r", BLOCK).step().run(ConnectorOnly())


def test_expectations_on_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="unknown observation fields"):
        Scenario(CONFIG).add("r", BLOCK).step(storez=[]).vector()


def test_kvconform_replay_checks_a_scenario_file_and_prints_the_diff(tmp_path):
    from click.testing import CliRunner

    from kvconform.cli import main

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(skip_read_scenario(stored_after_skip=[]).vector().to_json()))
    wrong = [{"request_id": "skip", "offload_indices": [0], "evicted": []}]
    bad.write_text(json.dumps(skip_read_scenario(stored_after_skip=wrong).vector().to_json()))
    passed = CliRunner().invoke(main, ["replay", str(good), "--adapter", "reference"])
    assert passed.exit_code == 0, passed.output
    assert "every expectation met" in passed.output
    failed = CliRunner().invoke(main, ["replay", str(bad), "--adapter", "reference"])
    assert failed.exit_code == 1, failed.output
    assert "OFF-READ-3" in failed.output and "+ observed []" in failed.output


SCENARIO_MUTANTS = {
    "seed-skip-read-sync": "skip-flag-ignored",
    "seed-skip-read-async": "skip-returns-early",
    "seed-skip-read-long-sync": "skip-returns-early",
    "seed-skip-read-long-async": "skip-flag-ignored",
    "skip-read-black-box-sync": "skip-returns-early",
    "skip-read-black-box-async": "skip-flag-ignored-black-box",
    "fence-store-flushed-before-reuse": "frees-while-storing",
    "preemption-flushes-stores-in-flight": "stores-not-flushed-on-preemption",
    "failed-load-recomputed": "failed-load-kept",
    "abort-during-load": "leaks-on-abort-during-load",
    "tenant-isolation": "cross-tenant-hit-black-box",
    "load-finishes-inside-the-step": "load-never-reported",
    "decoded-prefix-reloaded": "decoded-blocks-not-offloaded",
    "connector-reset-empties-store": "reset-keeps-store",
    "idle-engine-holds-no-blocks": "leaks-block-on-abort-black-box",
}
"""Each bundled scenario with a mutant that puts back the bug it illustrates: the scenario's negative control."""


def test_every_bundled_scenario_has_a_mutant_it_fails():
    assert set(SCENARIO_MUTANTS) == set(vectors.bundled())


@pytest.mark.parametrize("name", vectors.bundled())
def test_the_reference_meets_every_bundled_scenario(name):
    vectors.replay(vectors.load(name), ReferenceAdapter())


@pytest.mark.parametrize("name", vectors.bundled())
def test_the_mutant_of_a_bundled_scenario_fails_it_with_its_clause(name):
    from kvconform.conformance.mutants import MUTANTS

    vector = vectors.load(name)
    with pytest.raises(ClauseViolation) as raised:
        vectors.replay(vector, MUTANTS[SCENARIO_MUTANTS[name]].adapter())
    clauses = {vector.clause} | {clause for op in vector.ops for clause in op.get("clauses", {}).values()}
    assert raised.value.clause in clauses, raised.value
    assert "expected" in raised.value.detail or "still busy" in raised.value.detail


def test_a_prompt_names_the_tokens_an_earlier_request_decodes():
    """`tokens_of(R)` is R's prompt and all it decodes, as the KV content function fixes them (XFER-DATA-2)."""
    from kvconform.common import kv_content
    from kvconform.common.values import RequestSpec

    first = RequestSpec(request_id="a", prompt=(1, 2, 3), max_tokens=2, cache_salt="s")
    states = kv_content.token_states(kv_content.initial_state(None, "s"), first.prompt)
    decoded = kv_content.next_token(states[-1])
    then = kv_content.next_token(kv_content.token_states(0, (*first.prompt, decoded), states)[-1])
    args = {"request_id": "b", "prompt": [vectors.tokens_of("a"), 0], "max_tokens": 1}
    assert vectors.request_spec(args, {"a": first}).prompt == (1, 2, 3, decoded, then, 0)
    args = {"request_id": "c", "prompt": [vectors.output_of("a")], "max_tokens": 1}
    assert vectors.request_spec(args, {"a": first}).prompt == (decoded, then)
    with pytest.raises(ValueError, match="an earlier request id"):
        vectors.request_spec({"request_id": "d", "prompt": [{"tokens_of": "zz"}]}, {"a": first})


def test_a_decoded_prefix_reaches_the_adapter_as_tokens(tmp_path):
    """The JSON form keeps the reference; replay resolves it before the adapter sees the request."""
    path = tmp_path / "turns.json"
    scenario = (Scenario(CONFIG).add("a", BLOCK, max_tokens=3).drain()
                .add("b", [vectors.tokens_of("a"), 0]).step(scheduled_tokens={"b": 4}, match_answers=[
                    {"request_id": "b", "local_hit_tokens": 12, "external_tokens": 0, "load_async": False}]))
    path.write_text(json.dumps(scenario.vector().to_json()))
    assert '{"tokens_of": "a"}' in path.read_text()
    vectors.replay(vectors.load_file(path), ReferenceAdapter())


def test_a_scenario_using_an_operation_the_adapter_rules_out_is_refused():
    class Limited(ReferenceAdapter):
        def capabilities(self):
            return super().capabilities().model_copy(update={"preemption": False, "complete_in_step": False,
                                                             "block_size_factors": (1,)})

    refusals = {"preemption=False": Scenario(CONFIG.model_copy(update={"block_size_factor": 1})).add("r", BLOCK)
                .preempt("r"),
                "complete_in_step=False": Scenario(CONFIG.model_copy(update={"block_size_factor": 1})).add("r", BLOCK)
                .step(complete_transfers=True),
                "supports block_size_factors (1,), not 3": Scenario(CONFIG).add("r", BLOCK).step()}
    for reason, scenario in refusals.items():
        with pytest.raises(vectors.Unsupported, match=re.escape(reason)):
            scenario.run(Limited())


def test_a_drain_that_never_ends_names_the_leak():
    from kvconform.conformance.mutants import MUTANTS

    scenario = Scenario(CONFIG, level="connector").add("r", BLOCK, max_tokens=3).step().abort("r").drain()
    with pytest.raises(ClauseViolation, match="still busy after") as raised:
        scenario.run(MUTANTS["leaks-block-on-abort-black-box"].adapter())
    assert raised.value.clause == "KVC-LEAK-1"
