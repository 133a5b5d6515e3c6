"""Scenarios as connector authors write them (issue 14): the builder, the JSON form, and their diffs."""

import json

import pytest

from kvconform.adapters.contract import EngineConfig
from kvconform.adapters.reference import ReferenceAdapter
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


def preemption_flushes_stores_in_flight() -> Scenario:
    """LIFE-FREE-2: a request preempted while its store is in flight has that store flushed in the next step."""
    return (Scenario(CONFIG, clause="LIFE-FREE-2")
            .add("a", [1] * 12, max_tokens=4).step(stored=[])
            .preempt("a").step(flushed=[("a", (0,))]))


def test_preemption_scenario_passes_on_the_reference():
    preemption_flushes_stores_in_flight().run(ReferenceAdapter())


def test_preemption_scenario_fails_on_the_mutant_that_skips_the_flush():
    from kvconform.conformance.mutants import MUTANTS

    with pytest.raises(ClauseViolation) as raised:
        preemption_flushes_stores_in_flight().run(MUTANTS["stores-not-flushed-on-preemption"].adapter())
    assert raised.value.clause == "LIFE-FREE-2"
    assert "flushed_stores:" in raised.value.detail and "+ observed []" in raised.value.detail


def test_a_scenario_using_an_operation_the_adapter_rules_out_is_refused():
    class NoPreemption(ReferenceAdapter):
        def capabilities(self):
            return super().capabilities().model_copy(update={"preemption": False})

    with pytest.raises(vectors.Unsupported, match="preemption=False"):
        preemption_flushes_stores_in_flight().run(NoPreemption())
