"""The vLLM adapters: real vLLM judged by the kit (marked `vllm`).

The tests marked `vllm` need a vLLM release in this environment (`kvconform install-vllm 0.24.0`) and
skip, saying so, without one. Each expects the verdict of the installed release: vLLM 0.23.0 breaks the
seed rule (OFF-READ-1, fixed by vLLM PR 44592); later releases agree with the spec up to the known
failures shipped with the adapter.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter
from importlib import resources
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.vllm import lmcache, runtime, transfers
from kvconform.cli import main
from kvconform.common import kv_content
from kvconform.common.values import VARIANTS, BlockRef, EngineConfig, LoadJob, RequestSpec, StoreJob
from kvconform.conformance import baseline, options, runner, scenarios
from kvconform.conformance.execution import Call, Execution, Session, replay

VERSION = runtime.installed_version()
needs_vllm = pytest.mark.skipif(VERSION is None, reason="vLLM is not installed: kvconform install-vllm 0.24.0")
SEED_BUG_FIXED = {"offloading": VERSION != "0.23.0", "simple-cpu": VERSION not in ("0.23.0", "0.24.0")}
"""Whether the installed release keeps the seed rule: the OffloadingConnector from 0.24.0 (vLLM PR 44592), the
SimpleCPUOffloadConnector only once the 0.32 scheduler zeroes skip-read answers and it stops looking up."""


def adapter_class(kind: str) -> type:
    if kind == "offloading":
        from kvconform.adapters.vllm.offloading import VllmOffloadingAdapter

        return VllmOffloadingAdapter
    from kvconform.adapters.vllm.simple_cpu import VllmSimpleCPUAdapter

    return VllmSimpleCPUAdapter


def known_failures(name: str, version: str | None = VERSION) -> baseline.Baseline:
    """Return the known failures a run of the adapter uses on a release: the release's own (its scheduler's), then
    the adapter's (none where no file is shipped)."""
    folder = resources.files("kvconform.adapters.vllm").joinpath("known-failures")
    files = (folder.joinpath(f"vllm-{version}.txt"), folder.joinpath(f"{name}-{version}.txt"))
    return baseline.load(*(path for path in files if path.is_file()))


DEVIATIONS = sorted(p.name for p in resources.files("kvconform.adapters.vllm").joinpath("deviations").iterdir()
                    if p.name.endswith(".json"))
"""Programs that show a rare known failure: `ADAPTER-VERSION-CLAUSE.json`, failing CLAUSE on that release; for
`vllm-connector`, `vllm-connector-CONNECTOR-VERSION-CLAUSE.json`."""
DEVIATION_NAME = re.compile(r"^(?P<adapter>vllm-[a-z-]+?)(?:-(?P<connector>[A-Z][A-Za-z0-9]*))?"
                            r"-(?P<version>\d+\.\d+\.\d+)-(?P<clause>[A-Z-]+-\d+)\.json$")


def deviation(name: str) -> tuple[re.Match, list[Call]]:
    """Return a deviation program's name parts and its calls."""
    parts = DEVIATION_NAME.match(name)
    assert parts, f"{name} is not named ADAPTER-VERSION-CLAUSE.json"
    text = resources.files("kvconform.adapters.vllm").joinpath("deviations", name).read_text(encoding="utf-8")
    return parts, [Call.from_json(operation) for operation in json.loads(text)["program"]]


# --- without vLLM (installing: tests/test_install.py) ----------------------------------------------


def test_adapters_listed_without_importing_vllm() -> None:
    """Both vLLM adapters are registered entry points; listing them needs no vLLM."""
    result = CliRunner().invoke(main, ["adapters"])
    assert "vllm-offloading\t" in result.output and "vllm-simple-cpu\t" in result.output


@pytest.mark.parametrize("name", DEVIATIONS)
def test_recorded_deviation_is_a_listed_known_failure_the_reference_passes(name: str) -> None:
    """CONF-RUN-2: a program recorded for a rare known failure passes on the reference, and its clause is listed,
    marked rare, in the known failures of its adapter and release."""
    parts, program = deviation(name)
    known = known_failures(baseline_name(parts), parts["version"])
    assert parts["clause"] in known.rare, f"{parts['clause']} is not listed [rare] for {parts['adapter']}"
    assert replay(Session(ReferenceAdapter), program).violation is None


@pytest.mark.parametrize("adapter", ["vllm-offloading", "vllm-simple-cpu"])
def test_missing_vllm_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch, adapter: str) -> None:
    """Without vLLM, running a vLLM adapter is a usage error naming the install command."""
    monkeypatch.setattr(runtime, "installed_version", lambda: None)
    monkeypatch.setattr(runtime, "load", runtime.load.__wrapped__)
    result = CliRunner().invoke(main, ["run", "--adapter", adapter])
    assert result.exit_code == 2 and "kvconform install-vllm VERSION" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# --- real vLLM ----------------------------------------------------------------------------------


SCENARIO_DEVIATIONS = {
    "0.24.0": {
        # the seed bug, unfixed in this connector: get_num_new_matched_tokens (v1/simple_kv_offload/manager.py)
        # never reads skip_reading_prefix_cache, so a skip-read request is answered its CPU hit; judged at the
        # offloading level too, the white box shows it first as the lookup (its known failure OFF-READ-1)
        **{("vllm-simple-cpu", f"skip-read-black-box-{mode}"): "OFF-READ-1" for mode in ("sync", "async")},
        **{("vllm-connector-SimpleCPUOffloadConnector", f"skip-read-black-box-{mode}"): "KVC-SKIP-1"
           for mode in ("sync", "async")},
        # the store lag of its known failure OFF-STORE-1 (_prepare_eager_store_specs stores only blocks confirmed
        # at the next schedule): the block a request fills in its last steps is never stored
        ("vllm-simple-cpu", "decoded-prefix-reloaded"): "OFF-STORE-1",
        # a design choice the spec allows: a finished request's GPU blocks stay referenced (ref_cnt, request_finished
        # in manager.py) until its store completes, so they are never reused and no flush is needed; the next
        # request waits for blocks instead of flushing
        ("vllm-simple-cpu", "fence-store-flushed-before-reuse"): "LIFE-FREE-2",
        # a real bug: with a store still in flight when the last request finishes, the engine stops stepping
        # (Scheduler.has_requests, v1/core/sched/scheduler.py:2135, keeps it alive only for has_pending_push_work;
        # the connector's has_pending_transfers, simple_cpu_offload_connector.py:238, is called by nothing), so the
        # store's completion is never processed and its GPU blocks stay held until another request arrives; the
        # white box shows it first as the store's block never readable (its known failure OFF-MGR-1)
        ("vllm-simple-cpu", "idle-engine-holds-no-blocks"): "OFF-MGR-1",
        ("vllm-connector-SimpleCPUOffloadConnector", "idle-engine-holds-no-blocks"): "KVC-LEAK-1",
    },
}
"""The scenarios a vLLM adapter fails on a release, with the clause it fails (a known failure it ships, or not), each
read in vLLM's source: `vllm-connector-CONNECTOR` for the black box."""


needs_scenario_verdicts = pytest.mark.skipif(VERSION not in SCENARIO_DEVIATIONS,
                                             reason=f"scenario verdicts are recorded for vLLM "
                                                    f"{', '.join(SCENARIO_DEVIATIONS)}, not {VERSION}")


def check_scenario_verdict(adapter: Any, known: str, name: str, deviation_clause: str | None) -> None:
    """Run a bundled scenario as `kvconform replay --known-failures` does, with the known failures the adapter ships
    (`known`): met, refused for what the adapter lacks (a skip), or failed with `deviation_clause`, a known failure
    or not."""
    verdict = scenarios.judge(scenarios.load(name), Session(lambda: adapter, baseline=known_failures(known)))
    if verdict.outcome == "refused":
        pytest.skip(verdict.detail)
    assert verdict.clause == deviation_clause, verdict
    assert verdict.outcome in ("pass", "fail", "known failure"), verdict


@pytest.mark.vllm
@needs_vllm
@needs_scenario_verdicts
@pytest.mark.parametrize("name", scenarios.bundled())
@pytest.mark.parametrize("adapter_name", ["vllm-offloading", "vllm-simple-cpu"])
def test_bundled_scenario_on_vllm(adapter_name: str, name: str) -> None:
    """Every bundled scenario on the installed release, as its recorded deviations say."""
    adapter = adapter_class(adapter_name.removeprefix("vllm-"))()
    check_scenario_verdict(adapter, adapter_name, name, SCENARIO_DEVIATIONS[VERSION].get((adapter_name, name)))


@pytest.mark.vllm
@needs_vllm
@needs_scenario_verdicts
@pytest.mark.parametrize("name", scenarios.bundled())
@pytest.mark.parametrize("connector", ["OffloadingConnector", "SimpleCPUOffloadConnector"])
def test_bundled_scenario_on_vllm_connector(connector_environment: None, connector: str, name: str) -> None:
    """`vllm-connector`, the black box, agrees with the white-box adapter of the same connector on every scenario it
    can run (the connector-level ones): the same verdict, the same faults, named at the connector level."""
    adapter = connector_adapter(connector)()
    known = f"vllm-connector-{connector}"
    check_scenario_verdict(adapter, known, name, SCENARIO_DEVIATIONS[VERSION].get((known, name)))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_simple_cpu_skip_read_request(async_scheduling: bool) -> None:
    """OFF-READ-1: the SimpleCPUOffloadConnector looks a skip-read request up unless the release keeps the rule."""
    prompt = (0, 1, 2, 3) * 6
    adapter = adapter_class("simple-cpu")()
    adapter.start(EngineConfig(block_size=4, block_size_factor=1, num_gpu_blocks=32, num_offload_blocks=8,
                               async_scheduling=async_scheduling, **variants(adapter)))
    adapter.add_request(RequestSpec(request_id="fill", prompt=prompt, max_tokens=3))
    for _ in range(6):
        adapter.complete_transfers(False, False)
        adapter.step()
    assert adapter.store_contents().ready, "the eager store kept the first request's blocks"
    assert adapter.reset_prefix_cache(False)
    adapter.add_request(RequestSpec(request_id="skip", prompt=prompt, skip_reading_prefix_cache=True))
    lookups = adapter.step().lookups
    assert ("skip" in lookups) is not SEED_BUG_FIXED["simple-cpu"], lookups
    adapter.close()


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", ["offloading", "simple-cpu"])
def test_white_box_reads_the_bytes_at_rest_and_reports_each_job_once(kind: str, async_scheduling: bool) -> None:
    """XFER-DATA-3, CONN-STEP-4 on real vLLM: each block a completed store left readable reads back, through vLLM's own
    index of its store, as the KV of its tokens; every load and store job is reported finished once. Run directly: the
    state machine's examples on vllm-simple-cpu end at its known OFF-STORE-1 lag before any store completes."""
    adapter = adapter_class(kind)()
    adapter.start(EngineConfig(block_size=4, block_size_factor=1, num_gpu_blocks=32, num_offload_blocks=8,
                               async_scheduling=async_scheduling, **variants(adapter)))
    prompt = (0, 1, 2, 3, 1, 1) * 4
    created, completed = Counter(), Counter()
    stored: list[StoreJob] = []

    def step_until_idle(request_id: str) -> None:
        adapter.add_request(RequestSpec(request_id=request_id, prompt=prompt, max_tokens=3))
        for _ in range(6):
            adapter.complete_transfers(False, False)
            observation = adapter.step()
            created.update((*observation.loads, *observation.stores))
            completed.update((*observation.completed_loads, *observation.completed_stores))
            stored.extend(observation.completed_stores)

    step_until_idle("fill")
    assert adapter.reset_prefix_cache(False)
    step_until_idle("hit")
    assert stored and any(isinstance(job, LoadJob) for job in completed), (stored, completed)
    assert completed == created
    kv = kv_content.kv_values(kv_content.token_states(kv_content.initial_state(None, None), prompt), 8, torch.float16)
    for job in stored:
        for index in job.offload_indices:
            assert torch.equal(adapter.stored_kv(BlockRef(request_id=job.request_id, index=index)),
                               kv[4 * index : 4 * index + 4]), (job, index)
    adapter.close()


def baseline_name(parts: re.Match) -> str:
    """Return the known-failures name of a deviation's adapter: `vllm-connector-CONNECTOR` for the black box."""
    return "-".join(filter(None, (parts["adapter"], parts["connector"])))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", DEVIATIONS)
def test_recorded_deviation_fails_on_its_release(connector_environment: None, name: str) -> None:
    """A program recorded for a rare known failure fails exactly its clause on the release it was recorded for, for
    a cause its entry names."""
    parts, program = deviation(name)
    if parts["version"] != VERSION:
        pytest.skip(f"{name} is for vLLM {parts['version']}; {VERSION} is installed: "
                    f"kvconform install-vllm {parts['version']}")
    adapter = (connector_adapter(parts["connector"]) if parts["connector"]
               else adapter_class(parts["adapter"].removeprefix("vllm-")))
    violation = replay(Session(adapter), program).violation
    assert violation is not None and violation.clause == parts["clause"], violation
    known = known_failures(baseline_name(parts), parts["version"])
    assert known.tolerates(violation), f"no listed cause of {parts['clause']} matches: {violation.detail}"


OFFERED_AT_FINISH = [  # `kvconform run --adapter vllm-offloading --profile smoke` on 0.28.0, shrunk
    {"op": "start", "args": {"block_size": 4, "num_gpu_blocks": 64, "block_size_factor": 1, "num_offload_blocks": 12,
                             "max_num_batched_tokens": 256, "offer_at_finish": True, "flush_on_hit": True,
                             "defer_stores": True, "reset_forgets_stores": True}},
    {"op": "add_request", "args": {"request_id": "r0", "prompt": [2, 2, 2, 2], "max_tokens": 4}},
    {"op": "drain"},
]
"""A request of 8 tokens finishes; its last token's KV is never computed, yet 0.28 offers block 1 (tokens 4-7)."""


@pytest.mark.vllm
@pytest.mark.skipif(VERSION != "0.28.0",
                    reason="needs vLLM 0.28.0 (its own environment): kvconform install-vllm 0.28.0")
def test_an_uncomputed_block_offered_at_finish_is_known_by_its_cause_alone() -> None:
    """OFF-STORE-1, CONF-RUN-2: 0.28's offer of a finished request's last block, whose last token's KV was never
    computed (offloading/scheduler.py:1265-1266), fails without a file; the shipped 0.28 file covers it through the
    entry whose cause is /offered at finish/ only, and an entry of the same clause for another cause does not."""
    program = [Call.from_json(operation) for operation in OFFERED_AT_FINISH]
    alone = replay(Session(adapter_class("offloading")), program).violation
    assert alone is not None and alone.clause == "OFF-STORE-1", alone
    assert alone.detail.endswith("adapter {'r0': [(1,)]} (offered at finish: r0)"), alone.detail
    shipped = known_failures("vllm-offloading")
    assert replay(Session(adapter_class("offloading"), baseline=shipped), program).violation is None
    assert {name: count for name, count in shipped.met.items() if count} == {"OFF-STORE-1 /offered at finish/": 1}
    other = baseline.Baseline([entry for entry in shipped.listed if entry.clause != "OFF-STORE-1"] + baseline.parse(
        "OFF-STORE-1 /after a preemption/: another cause", "other.txt"))
    again = replay(Session(adapter_class("offloading"), baseline=other), program).violation
    assert again is not None and again.clause == "OFF-STORE-1" and not other.met, again


@pytest.mark.vllm
@needs_vllm
def test_failed_load_is_reported_however_the_release_names_it() -> None:
    """KVC-FAIL-1: a failed load is recorded whether the connector names it by block (`invalid_block_ids`) or by
    request (`failed_recving`, as 0.34's OffloadingConnector does; the adapter once read only the first)."""
    adapter = adapter_class("offloading")()
    if not adapter.capabilities().transfer_failures:
        pytest.skip(f"the OffloadingConnector of vLLM {VERSION} cannot report a failed transfer")
    scenarios.load("failed-load-recomputed").run(adapter)


def variants(adapter) -> dict[str, bool]:
    """Return the behaviour variants the adapter's release has (each vLLM release has one of each)."""
    capabilities = adapter.capabilities()
    return {name: getattr(capabilities, name)[0] for name in VARIANTS}


FINISH_STORES = {
    "another-request-took-a-freed-block": (  # --profile dev --seed 4 on 0.34.0: named as r2's block 1
        [RequestSpec(request_id="r2", prompt=(0, 2, 0, 2), max_tokens=4), 4,
         RequestSpec(request_id="r3", prompt=(1, 0, 3, 2)), 1], 16, (StoreJob(request_id="r3", offload_indices=(0,)),)),
    "a-running-request-hits-the-block": (  # --profile dev --seed 6 on 0.34.0: block 0 named as r2's
        [RequestSpec(request_id="r1", prompt=(2,) * 14 + (1, 2)), RequestSpec(request_id="r2", prompt=(2,) * 5), 1],
        2, (StoreJob(request_id="r1", offload_indices=(0, 1)),)),
}
"""A program of requests and step counts ending one step before a store queued at a finish, the CPU blocks of the
store, and the store jobs vLLM must be seen to issue in the next step."""


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", sorted(FINISH_STORES))
def test_a_store_queued_at_a_finish_is_named_after_the_request_that_finished(name: str) -> None:
    """OFF-STORE-2: simple-cpu names the blocks of a store queued at a request's finish after that request: not after
    an earlier finished request whose store state vLLM keeps, block list included, while another request took one of
    those freed blocks; not after a running request whose prefix hit shares the block."""
    adapter = adapter_class("simple-cpu")()
    if True not in adapter.capabilities().offer_at_finish:
        pytest.skip(f"the SimpleCPUOffloadConnector of vLLM {VERSION} stores nothing at a finish")
    program, num_offload_blocks, expected = FINISH_STORES[name]
    adapter.start(EngineConfig(block_size=4, num_gpu_blocks=64, block_size_factor=1,
                               num_offload_blocks=num_offload_blocks, max_num_batched_tokens=16, **variants(adapter)))
    for operation in program:
        if isinstance(operation, RequestSpec):
            adapter.add_request(operation)
        for _ in range(operation if isinstance(operation, int) else 0):
            adapter.step()
    stores = adapter.step().stores
    adapter.close()
    assert stores == expected, stores


@pytest.mark.long
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("kind", ["offloading", "simple-cpu"])
def test_state_machine_verdict(kind: str) -> None:
    """The state machine's verdict on the installed release, with the known failures the adapter ships: vLLM
    0.23.0's OffloadingConnector fails the seed rule (OFF-READ-1) with a counterexample of at most 3 requests once
    its file's entry for it is left out (the file lists it so that runs go past it); otherwise nothing fails but
    those (an entry a short run happens not to meet is reported stale, CONF-RUN-2)."""
    name = f"vllm-{kind}"
    known = known_failures(name)
    seed_bug = kind == "offloading" and not SEED_BUG_FIXED[kind]
    if seed_bug:
        known.listed = [entry for entry in known.listed if entry.clause != "OFF-READ-1"]
    result = runner.run(adapter_class(kind), name, "smoke", baseline=known)
    assert result.statistics.steps > 0
    if seed_bug:
        assert result.failed_clause == "OFF-READ-1", (result.failed_clause, result.message, result.counterexample)
        assert result.counterexample_requests <= 3, result.counterexample
    else:
        assert result.failed_clause in (None, "CONF-RUN-2"), (result.failed_clause, result.message,
                                                               result.counterexample)


# --- vllm-connector: any KVConnectorBase_V1, black box ------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("arguments, message", [
    (["--connector", "NoSuchConnector"], "unknown connector 'NoSuchConnector'"),
    (["--connector", "json:JSONDecoder"], "is not a KVConnectorBase_V1 subclass"),
    (["--connector", "ExampleConnector", "--connector-config", "{not json"], "KVCONFORM_CONNECTOR_CONFIG is not JSON"),
    (["--connector", "ExampleConnector", "--connector-manifest", '{"abort": 3}'], "KVCONFORM_CONNECTOR_MANIFEST"),
    ([], "vllm-connector needs a connector"),
])
def test_vllm_connector_bad_input_is_one_line_exit_2(connector_environment: None, arguments: list[str],
                                                     message: str) -> None:
    """A connector vLLM cannot build, bad JSON or a bad manifest is a usage error: one line, exit 2."""
    result = CliRunner().invoke(main, ["run", "--adapter", "vllm-connector", "--profile", "smoke", *arguments])
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


EXAMPLE_CONNECTOR_FAULTS = [
    ("KVC-MATCH-1", [RequestSpec(request_id="r0", prompt=(2,)), RequestSpec(request_id="r1", prompt=(2,))]),
    ("KVC-HIT-1", [RequestSpec(request_id="r0", prompt=(0, 2) * 5, lora_name="lora-x"),
                   RequestSpec(request_id="r1", prompt=(0, 2) * 5)]),
]
"""Programs ExampleConnector fails (vLLM 0.34.0 example_connector.py): a negative answer for a 1-token prompt
(align_to_block_size(0) < 0), and another tenant's KV offered (its folder key has no cache_salt or LoRA)."""


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("clause, requests", EXAMPLE_CONNECTOR_FAULTS)
def test_example_connector_fails_the_connector_level(connector_environment: None, clause: str,
                                                     requests: list[RequestSpec]) -> None:
    """vLLM's ExampleConnector, judged as a black box, fails these clauses; the reference passes the same programs."""
    options.select_connector("ExampleConnector")
    from kvconform.adapters.vllm.connector import VllmConnectorAdapter

    program = [Call("start", (EngineConfig(block_size_factor=1),))]
    for request in requests:
        program += [Call("add_request", (request,)), Call("drain")]
    assert replay(Session(ReferenceAdapter), program).violation is None
    violation = replay(Session(VllmConnectorAdapter), program).violation
    assert violation is not None and violation.clause == clause, violation


# --- vllm-connector on connectors whose workers copy with CUDA: the seams -------------------------


def connector_adapter(name: str) -> type:
    """Return `vllm-connector` with connector `name` selected (the fixture `connector_environment` forgets it)."""
    options.select_connector(name)
    from kvconform.adapters.vllm.connector import VllmConnectorAdapter

    return VllmConnectorAdapter


def offered_after_local_reset(adapter: Any, prompt: tuple[int, ...]) -> int:
    """KVC-SAVE-1's positive control on vLLM's own schedule: run `prompt` to its end and a few steps more (a
    connector may store a finished request's blocks in later steps), reset the local prefix cache only, send the
    prompt again and return the external tokens the connector offers it; the adapter is closed."""
    adapter.start(EngineConfig(block_size_factor=1, num_offload_blocks=32))
    adapter.add_request(RequestSpec(request_id="first", prompt=prompt, max_tokens=3))
    for _ in range(6):
        adapter.complete_transfers(False, False)
        adapter.step()
    assert adapter.reset_prefix_cache(False)
    adapter.add_request(RequestSpec(request_id="again", prompt=prompt))
    answers = [a for a in adapter.step().match_answers if a.request_id == "again"]
    adapter.close()
    return answers[0].external_tokens or 0


SEAM_CONNECTORS = {"offloading": "OffloadingConnector", "simple-cpu": "SimpleCPUOffloadConnector"}
"""vLLM's own offloading connectors by the kind of their white-box adapter."""


def skip_read_program(async_scheduling: bool, prompt: tuple[int, ...]) -> list[Call]:
    """Return vLLM's regression scenario for the seed rule, then a plain read of the same prompt: fill the store,
    reset the local prefix cache, send the prompt with skip_reading_prefix_cache, reset again, send it again. Each
    request decodes 3 tokens: up to 0.24 the SimpleCPUOffloadConnector never stores the blocks of a request that
    finishes in the step that fills them (vllm-simple-cpu's OFF-STORE-1)."""
    program = [Call("start", (EngineConfig(block_size_factor=1, async_scheduling=async_scheduling),))]
    for request_id, skip in (("fill", False), ("skip", True), ("read", False)):
        program += [Call("add_request", (RequestSpec(request_id=request_id, prompt=prompt, max_tokens=3,
                                                     skip_reading_prefix_cache=skip),)),
                    Call("drain"), Call("reset_prefix_cache", (False,))]
    return program


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", sorted(SEAM_CONNECTORS))
def test_black_box_agrees_with_white_box_on_the_seed_rule(connector_environment: None, kind: str,
                                                           async_scheduling: bool) -> None:
    """KVC-SKIP-1 through vllm-connector, with the connector's CPU seam and no vendor code: it fails exactly on the
    releases whose white-box adapter fails OFF-READ-1 (the OffloadingConnector on 0.23.0, the SimpleCPUOffloadConnector
    up to 0.24.0); elsewhere the whole program passes, the plain read's loaded bytes included (KVC-DATA-1)."""
    program = skip_read_program(async_scheduling, (0, 1, 2, 3) * 6)
    assert replay(Session(ReferenceAdapter), program).violation is None
    adapter = connector_adapter(SEAM_CONNECTORS[kind])
    violation = replay(Session(adapter), program).violation
    if SEED_BUG_FIXED[kind]:
        assert violation is None, violation
    else:
        assert violation is not None and violation.clause == "KVC-SKIP-1", violation


ADAPTER_COPY = transfers.KVTensors.copy
"""The vLLM adapters' own copy between the GPU KV tensor and the CPU store, shared with no reference code."""


def crossed_loads(kv_tensors: transfers.KVTensors, copy: transfers.Copy) -> None:
    """A broken copy: a load pairs the GPU blocks with the store rows in reverse order (a store is copied intact)."""
    if not copy.is_store:
        copy = transfers.Copy(False, copy.gpu_blocks[::-1], copy.rows)
    ADAPTER_COPY(kv_tensors, copy)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("kind, white_box", [("offloading", True), ("offloading", False), ("simple-cpu", False)],
                         ids=["vllm-offloading", "vllm-connector-offloading", "vllm-connector-simple-cpu"])
def test_a_broken_copy_in_the_adapter_fails_the_byte_check(connector_environment: None, monkeypatch: pytest.MonkeyPatch,
                                                           kind: str, white_box: bool) -> None:
    """XFER-DATA-1 / KVC-DATA-1 judge the bytes the adapter's own copy moves: a program that stores a prompt and loads
    it back passes, and fails its byte check once the adapter's load copy is broken; the reference, which copies with
    code of its own, is untouched. (vllm-simple-cpu's offers fail their known failure OFF-STORE-1 before the load, so
    its seam is judged through the black box.)"""
    adapter = adapter_class(kind) if white_box else connector_adapter(SEAM_CONNECTORS[kind])
    program = [Call("start", (EngineConfig(block_size_factor=1, **variants(adapter())),))]
    for request_id in ("fill", "read"):
        program += [Call("add_request", (RequestSpec(request_id=request_id, prompt=(0, 1, 2, 3) * 6, max_tokens=3),)),
                    Call("drain"), Call("reset_prefix_cache", (False,))]
    assert replay(Session(adapter), program).violation is None
    monkeypatch.setattr(transfers.KVTensors, "copy", crossed_loads)
    violation = replay(Session(adapter), program).violation
    data_clause = "XFER-DATA-1" if white_box else "KVC-DATA-1"
    assert violation is not None and violation.clause == data_clause, violation
    assert replay(Session(ReferenceAdapter), program).violation is None


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("kind", sorted(SEAM_CONNECTORS))
def test_black_box_seam_saves_and_reports_the_connector_level_only(connector_environment: None, kind: str) -> None:
    """KVC-SAVE-1's positive control passes through the seam (it moves the bytes), and the black box claims and
    reports the connector level alone: none of the offloading level's observations."""
    adapter = connector_adapter(SEAM_CONNECTORS[kind])()
    assert adapter.capabilities().levels == ("connector",)
    observations = []
    adapter.step = lambda step=adapter.step: observations.append(step()) or observations[-1]
    assert offered_after_local_reset(adapter, (1, 2, 3, 0) * 6) > 0
    assert not any(o.lookups or o.loads or o.store_offers or o.stores or o.evicted for o in observations), observations


# --- vllm-connector with tensor parallelism: one worker-side connector per rank ----------------------


def save_and_load_program(ranks: int) -> list[Call]:
    """Return a program that saves a prompt, resets the local prefix cache and loads the prompt back with `ranks`
    tensor-parallel ranks: the loaded bytes are judged (KVC-DATA-1)."""
    program = [Call("start", (EngineConfig(block_size_factor=1, tensor_parallel_size=ranks),))]
    for request_id in ("fill", "read"):
        program += [Call("add_request", (RequestSpec(request_id=request_id, prompt=(0, 1, 2, 3) * 6, max_tokens=3),)),
                    Call("drain"), Call("reset_prefix_cache", (False,))]
    return program


PROCESS_STATE = "tests.process_state_connector:ProcessStateConnector"


@pytest.mark.vllm
@needs_vllm
def test_a_connector_with_per_process_state_passes_at_two_ranks(connector_environment: None) -> None:
    """Issue 38 item 1: each rank's worker-side connector runs in a process of its own, as in vLLM, so a correct
    connector whose store is module state per process passes at TP 2 with no change to it. Its ranks in one process
    (`--ranks in-process`, the speed option) read one another's heads: the false alarm, KVC-DATA-1."""
    adapter = connector_adapter(PROCESS_STATE)
    program = save_and_load_program(2)
    execution = Execution(Session(adapter))
    execution.begin()
    for call in program:
        execution.apply(call)
    execution.close()
    assert execution.coverage["KVC-DATA-1"] >= 1
    options.select_connector(None, None, None, None, "in-process")
    violation = replay(Session(adapter), program).violation
    assert violation is not None and violation.clause == "KVC-DATA-1" and "the heads of rank(s)" in violation.detail


def one_ranks_heads(adapter: Any) -> transfers.RankedTransfers:
    """A broken rank: every rank's copies move rank 0's heads, so rank 1 saves and loads another rank's share."""
    return transfers.RankedTransfers([adapter.kv.ranks[0]] * len(adapter.kv.ranks))


@pytest.mark.vllm
@needs_vllm
def test_each_rank_moves_its_own_heads(connector_environment: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """OffloadingConnector with two ranks: each rank's worker holds its half of the heads, vLLM's KVOutputAggregator
    expects both ranks' reports, and a prompt saved and loaded back is judged on every rank's bytes (KVC-DATA-1). With
    a rank that copies another rank's heads (the mutant) the same program fails KVC-DATA-1."""
    from kvconform.adapters.vllm.engine import VllmAdapter

    adapter = connector_adapter("OffloadingConnector")
    program = save_and_load_program(2)
    probe = adapter()
    probe.start(program[0].args[0])
    assert [kv.gpu.shape[2] for kv in probe.kv.ranks] == [4, 4] and probe.worker is probe.ranks[0].worker
    assert probe.ranks[1].worker is not probe.worker and probe.aggregator._expected_finished_count == 2
    probe.close()
    assert replay(Session(adapter), program).violation is None
    monkeypatch.setattr(VllmAdapter, "held_transfers", one_ranks_heads)
    violation = replay(Session(adapter), program).violation
    assert violation is not None and violation.clause == "KVC-DATA-1", violation


class LaggingRank(transfers.RankedTransfers):
    """A slower rank 1: a transfer finishes on rank 1 only at the second completion after rank 0 finished it, when
    rank 0's report has reached the scheduler and the request could run. Transfers succeed (no failure is drawn)."""

    def __init__(self, kv_tensors: Any) -> None:
        super().__init__(kv_tensors)
        self.waited: Counter[int] = Counter()

    def complete(self, fail_loads: bool = False, fail_stores: bool = False) -> None:
        self.ranks[0].complete(fail_loads, fail_stores)
        lagging = self.ranks[1]
        self.waited.update(list(lagging.held))
        lagging.wait(job for job, completions in self.waited.items() if completions > 2)


def one_rank_aggregator(adapter: Any) -> Any:
    """A broken aggregation (the mutant): a transfer counts as finished once one rank reported it."""
    return adapter.rt.load("vllm.distributed.kv_transfer.kv_connector.utils").KVOutputAggregator(1)


@pytest.mark.vllm
@needs_vllm
def test_a_load_is_finished_only_when_every_rank_reported_it(connector_environment: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """OffloadingConnector with two ranks, rank 1 a completion behind rank 0: vLLM's KVOutputAggregator holds the
    request until both ranks loaded, and the program passes. Aggregation that counts one rank (the mutant) lets the
    request run on rank 1's missing heads: KVC-DATA-1 names rank 1."""
    from kvconform.adapters.vllm.engine import VllmAdapter

    adapter, program = connector_adapter("OffloadingConnector"), save_and_load_program(2)
    monkeypatch.setattr(VllmAdapter, "held_transfers", lambda self: LaggingRank(self.kv.ranks))
    assert replay(Session(adapter), program).violation is None
    monkeypatch.setattr(VllmAdapter, "output_aggregator", one_rank_aggregator)
    violation = replay(Session(adapter), program).violation
    assert violation is not None and violation.clause == "KVC-DATA-1", violation
    assert "the heads of rank(s) [1]" in violation.detail, violation


@pytest.mark.vllm
@needs_vllm
def test_example_connector_ranks_overwrite_each_others_files(connector_environment: None) -> None:
    """vLLM 0.34.0's ExampleConnector names a saved file by its tokens and layer, not its rank
    (example_connector.py:411-423 `_generate_filename_debug`): with two ranks, rank 1's save overwrites rank 0's and
    both load rank 1's heads (KVC-DATA-1); with one rank the same program passes."""
    adapter = connector_adapter("ExampleConnector")
    assert replay(Session(adapter), save_and_load_program(1)).violation is None
    violation = replay(Session(adapter), save_and_load_program(2)).violation
    assert violation is not None and violation.clause == "KVC-DATA-1", violation


@pytest.mark.vllm
@needs_vllm
def test_parallel_state_answers_the_rank_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parallel-state seam: a getter imported by name answers the rank inside `tensor_parallel_rank` and vLLM's own
    answer after it; `get_tp_group` is refused with the one line that names the fix."""
    import types

    from vllm.distributed import parallel_state

    importer = types.ModuleType("kvconform_test_importer")
    importer.get_tensor_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank  # type: ignore[attr-defined]
    importer.get_tp_group = parallel_state.get_tp_group  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    with runtime.tensor_parallel_rank(1, 2):
        assert importer.get_tensor_model_parallel_rank() == 1  # type: ignore[attr-defined]
        assert parallel_state.get_tensor_model_parallel_world_size() == 2
        with pytest.raises(runtime.NeedsProcessGroup, match="--tensor-parallel-size 1"):
            importer.get_tp_group()  # type: ignore[attr-defined]
    restored = importer.get_tensor_model_parallel_rank  # type: ignore[attr-defined]
    assert restored is parallel_state.get_tensor_model_parallel_rank


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("size", ["3", "0"])
def test_a_tensor_parallel_size_refused_is_one_line_exit_2(connector_environment: None, size: str) -> None:
    """A size the adapter does not run is refused before the run: one line, exit 2, no traceback."""
    result = CliRunner().invoke(main, ["run", "--adapter", "vllm-connector", "--connector", "ExampleConnector",
                                       "--profile", "smoke", "--tensor-parallel-size", size])
    assert result.exit_code == 2 and f"runs tensor-parallel sizes 1, 2, not {size}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr


# --- LMCache ------------------------------------------------------------------------------------

LMCACHE_VLLM = "0.24.0"
"""The vLLM release LMCache 0.5.6 runs with: on 0.34.0 its build_connector_meta raises AttributeError for every
request it sees again (0.34's CachedRequestData has no resumed_req_ids; vllm_v1_adapter.py:1761-1773)."""
needs_lmcache = pytest.mark.skipif(importlib.util.find_spec("lmcache") is None or VERSION != LMCACHE_VLLM,
                                   reason=f"needs lmcache 0.5.6 over vLLM {LMCACHE_VLLM}: "
                                          f"kvconform install-vllm {LMCACHE_VLLM} && {lmcache.INSTALL}")

LMCACHE_PROMPT = tuple(range(40))
"""Two and a half of LMCache's 16-token chunks."""

LMCACHE_FAULTS = [
    ("KVC-HIT-1", [Call("add_request", (RequestSpec(request_id="a", prompt=LMCACHE_PROMPT, cache_salt="tenant-a"),)),
                   Call("drain"), Call("reset_prefix_cache", (False,)),
                   Call("add_request", (RequestSpec(request_id="b", prompt=LMCACHE_PROMPT, cache_salt="tenant-b"),)),
                   Call("drain")]),
    ("KVC-DATA-1", [Call("add_request", (RequestSpec(request_id="plain", prompt=(1, 0, 3, 2) * 4),)),
                    Call("add_request", (RequestSpec(request_id="a", prompt=((1, 0, 3, 2) * 4)[:15],
                                                     cache_salt="tenant-a"),)),
                    Call("drain"),
                    Call("add_request", (RequestSpec(request_id="again", prompt=(1, 0, 3, 2) * 4, max_tokens=3,
                                                     cache_salt="tenant-a"),)),
                    Call("drain")]),
    ("KVC-SKIP-1", skip_read_program(False, LMCACHE_PROMPT)[1:]),
]
"""Programs LMCache 0.5.6 fails on vLLM 0.24.0: another tenant's chunks offered (its keys hash token ids only); a
request whose own tenant computed its first 15 tokens loads, beyond its local hit of 12, the 16-token chunk a request
without salt stored (the ci run's counterexample, shrunk); a skip-read request answered its hit (it never reads the
flag)."""


def test_lmcache_known_failures_each_have_a_program() -> None:
    """CONF-RUN-2: every clause LMCache's known-failures file lists has a program here that shows it."""
    own = f"vllm-connector-LMCacheConnectorV1-{LMCACHE_VLLM}.txt"  # the release's scheduler file aside
    listed = baseline.load(resources.files("kvconform.adapters.vllm").joinpath("known-failures", own)).entries
    assert set(listed) == {clause for clause, _ in LMCACHE_FAULTS}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="lmcache is installed")
def test_lmcache_absent_is_one_line_exit_2_naming_its_install(connector_environment: None) -> None:
    """Without lmcache, naming LMCacheConnectorV1 is a usage error that gives the one-line install."""
    result = CliRunner().invoke(main, ["run", "--adapter", "vllm-connector", "--connector", "LMCacheConnectorV1"])
    assert result.exit_code == 2 and lmcache.INSTALL in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.lmcache
@pytest.mark.vllm
@needs_lmcache
def test_lmcache_reloads_what_it_saved_byte_for_byte(connector_environment: None) -> None:
    """LMCacheConnectorV1 through vllm-connector and the torch copy: a prompt saved, the local prefix cache reset,
    the prompt asked again with two tokens more is offered whole chunks and loads them byte for byte (KVC-SAVE-1's
    positive control, KVC-HIT-1, KVC-DATA-1). It runs one rank: its worker asks for a process group
    (`get_tp_group()`), which ranks in one process do not have."""
    adapter = connector_adapter("LMCacheConnectorV1")
    assert adapter().capabilities().tensor_parallel_sizes == (1,)
    assert offered_after_local_reset(adapter(), LMCACHE_PROMPT) == 32
    program = [Call("start", (EngineConfig(block_size_factor=1),)), *LMCACHE_FAULTS[0][1][:3],
               Call("add_request", (RequestSpec(request_id="longer", prompt=LMCACHE_PROMPT + (7, 7),
                                                cache_salt="tenant-a"),)), Call("drain")]
    assert replay(Session(adapter), program).violation is None


@pytest.mark.lmcache
@pytest.mark.vllm
@needs_lmcache
@pytest.mark.parametrize("clause, calls", LMCACHE_FAULTS, ids=[clause for clause, _ in LMCACHE_FAULTS])
def test_lmcache_fails_its_known_failures(connector_environment: None, clause: str, calls: list[Call]) -> None:
    """Each clause LMCache's known-failures file lists fails on a short program the reference passes."""
    program = [Call("start", (EngineConfig(block_size_factor=1),)), *calls]
    assert replay(Session(ReferenceAdapter), program).violation is None
    violation = replay(Session(connector_adapter("LMCacheConnectorV1")), program).violation
    assert violation is not None and violation.clause == clause, violation
