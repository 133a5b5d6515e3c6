"""vLLM 0.34.0's NixlConnector through the real NIXL wheels (`vllm-pd`, chapter `disaggregated`): a producer's KV
read by a consumer over UCX on loopback is judged conformant, with both engines in this process and with the producer
in a process of its own, and a malformed forward gets a per-clause verdict.

Marked `nixl`: they need vLLM 0.34.0 and the NIXL wheels in this environment (`kvconform install-vllm 0.34.0 --nixl`,
or its release environment); without them they skip with that line."""

from __future__ import annotations

import importlib.util
import json
import time
from importlib import resources
from pathlib import Path

import pytest

from kvconform.adapters.vllm import pd, runtime
from kvconform.adapters.vllm.connector import CONNECTOR_CONFIG
from kvconform.adapters.vllm.pd import INSTALL, VllmPDAdapter
from kvconform.adapters.vllm.processes import ProcessLost, stop_servers
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.conformance import baseline
from kvconform.conformance.operations import Call
from tests.test_disaggregated_level import run

pytestmark = [pytest.mark.nixl, pytest.mark.vllm,
              pytest.mark.skipif(runtime.installed_version() != "0.34.0" or importlib.util.find_spec("nixl") is None,
                                 reason=f"needs vLLM 0.34.0 and the NIXL wheels: {INSTALL}")]

PROMPT = tuple(range(1, 19))
"""Four full blocks and a partial one."""

DRAIN_TIMEOUT = 60.0
"""Seconds the drain of a handed-over prefill waits for the pair: the first example's drain holds NIXL's first
handshakes over UCX, between rank processes at TP 2, which took 3-7 s on a quiet 2-core machine and over 11 s in CI
under load (a false KVC-LIVE-1 at the default 10 s). An upper bound only: a correct pair finishes sooner."""

KNOWN = "vllm-pd-NixlConnector-0.34.0.txt"
KNOWN_PUSH = "vllm-pd-NixlConnector-push-0.34.0.txt"


def hand_over(override: dict | None = None, size: int = 1) -> list[Call]:
    """Prefill one prompt on the producer and forward its params (with `override`) to the consumer; `run` drains."""
    config = EngineConfig(block_size=4, num_gpu_blocks=16, block_size_factor=1, tensor_parallel_size=size)
    return [Call("start", (config,)), Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)),
            Call("step"), Call("step"),
            Call("decode", (RequestSpec(request_id="d", prompt=PROMPT, max_tokens=3), "p",
                            *([override] if override else [])))]


@pytest.fixture(params=["1", "2"], ids=["one process", "two processes"])
def processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both engines in this process, or the producer in a process of its own (`--pd-processes`)."""
    monkeypatch.setenv(pd.PROCESSES, request.param)
    return str(request.param)


@pytest.mark.parametrize("size", [1, 2])
def test_a_prefill_read_by_the_consumer_is_conformant(size: int, processes: str) -> None:
    """PD-PARAMS-1, PD-LOAD-1, PD-DATA-1, PD-HOLD-1, PD-NOTIFY-1, PD-TP-1: the consumer's blocks hold the producer's KV
    byte for byte after NIXL's read, each rank its heads, and the producer frees its blocks on the notification of
    every rank. Before the finish hook `request_finished_all_groups` was recorded, PD-PARAMS-1 failed here: no delayed
    free was seen. Across processes the handshake's compatibility check passes (`enforce_handshake_compat`, on by
    default, compares a hash that includes the model): both engines name one model directory."""
    assert run(VllmPDAdapter, hand_over(size=size), DRAIN_TIMEOUT) is None


@pytest.mark.parametrize("size", [1, 2])
def test_a_prefill_pushed_by_the_producer_is_conformant(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """NixlConnector in push mode: the consumer registers its blocks, the producer writes its KV into them, each rank
    its heads. It pairs the decode with its prefill by the request id the proxy sends both engines (before the adapter
    did, the consumer never reported the receive: PD-ONCE-1), and ends its hold when its write completed, before the
    consumer reports the receive (PD-HOLD-1's MAY)."""
    monkeypatch.setenv(CONNECTOR_CONFIG, json.dumps({"transfer_mode": "push"}))
    assert run(VllmPDAdapter, hand_over(size=size), DRAIN_TIMEOUT) is None


def test_a_malformed_forward_gets_a_per_clause_verdict_not_a_traceback(processes: str) -> None:
    """Params naming blocks as a string the consumer cannot read are judged under a PD clause, never CONF-CALL-1."""
    violation = run(VllmPDAdapter, hand_over({"remote_block_ids": "not-held"}))
    assert violation is not None and violation.clause.startswith("PD-"), violation


def test_params_lacking_blocks_aborted_before_the_read_get_a_per_clause_verdict() -> None:
    """PD-PARAMS-2: a consumer request forwarded without `remote_block_ids` and aborted before it was scheduled makes
    NIXL 0.34's scheduler raise KeyError in its next step (`nixl/pull_scheduler.py`:222-233, `nixl/metadata.py`:341),
    judged under PD-PARAMS-2, never CONF-CALL-1 (the ci profile found it as CONF-CALL-1)."""
    decode = hand_over({"remote_block_ids": None})[-1]
    violation = run(VllmPDAdapter, [*hand_over({"remote_block_ids": None}), Call("abort", (decode.args[0].request_id,)),
                                    Call("step")])
    assert violation is not None and violation.clause == "PD-PARAMS-2", violation


def test_a_producer_process_that_exits_is_named_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's process that dies mid-run ends the call that waits on it with one line saying so, never a hang;
    the next adapter starts a process of its own."""
    monkeypatch.setenv(pd.PROCESSES, "2")
    adapter = VllmPDAdapter()
    adapter.start(hand_over()[0].args[0])
    server = adapter.engines["producer"].server
    server.process.kill()
    with pytest.raises(ProcessLost, match=r"the producer's process exited \(code -9\) (during|before) "
                                                   r"pair_step"):
        adapter.step()
    adapter.close()
    assert run(VllmPDAdapter, hand_over(), DRAIN_TIMEOUT) is None
    assert pd.producer_server() is not server


def consumer_receive(model_directory: str) -> tuple[bool, bool]:
    """Hand a prefill over from a producer process given `model_directory` to the consumer here; return whether the
    consumer reported the receive and whether it reported it failed."""
    stop_servers("producer")
    pd.producer_server(model_directory)
    adapter = VllmPDAdapter()
    try:
        start, prefill, *_ = hand_over()
        adapter.start(start.args[0])
        adapter.prefill(prefill.args[0])
        deadline = time.monotonic() + 20
        while "p" not in adapter.returned and time.monotonic() < deadline:
            adapter.step()
        adapter.decode(RequestSpec(request_id="d", prompt=PROMPT, max_tokens=3), "p")
        while time.monotonic() < deadline:
            consumer = adapter.step().disaggregated.consumer
            if "d" in consumer.finished_recving:
                return True, "d" in consumer.failed_recving
        return False, False
    finally:
        adapter.close()


def test_the_handshake_compatibility_check_stays_under_test(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """Across processes both engines name one model directory, so NIXL's handshake, whose compatibility hash includes
    the model (`enforce_handshake_compat`, on), accepts the producer and the read succeeds; a producer given a directory
    of its own is refused, and the consumer reports the receive failed."""
    monkeypatch.setenv(pd.PROCESSES, "2")
    assert consumer_receive(runtime.load().model_config.model) == (True, False)
    (tmp_path / "config.json").write_text(json.dumps(runtime.OPT_125M_CONFIG))
    assert consumer_receive(str(tmp_path)) == (True, True)
    stop_servers("producer")


@pytest.mark.parametrize("known", [KNOWN, KNOWN_PUSH])
def test_the_shipped_known_failures_are_each_classified(known: str) -> None:
    """Every entry of the shipped files says whether it is a bug of the release (file:line) or a design choice."""
    listed = baseline.load(resources.files("kvconform.adapters.vllm").joinpath("known-failures", known)).listed
    assert listed and all(entry.reason.split(":")[0] in ("bug", "design") for entry in listed)
