"""vLLM 0.34.0's NixlConnector through the real NIXL wheels (`vllm-pd`, chapter `disaggregated`): a producer's KV
read by a consumer over UCX on loopback is judged conformant, and a malformed forward gets a per-clause verdict.

Marked `nixl`: they need vLLM 0.34.0 and the NIXL wheels in this environment (`kvconform install-vllm 0.34.0 --nixl`,
or its release environment); without them they skip with that line."""

from __future__ import annotations

import importlib.util
from importlib import resources

import pytest

from kvconform.adapters.vllm import runtime
from kvconform.adapters.vllm.pd import INSTALL, VllmPDAdapter
from kvconform.common.values import EngineConfig, RequestSpec
from kvconform.conformance import baseline
from kvconform.conformance.operations import Call
from tests.test_disaggregated_level import run

pytestmark = [pytest.mark.nixl, pytest.mark.vllm,
              pytest.mark.skipif(runtime.installed_version() != "0.34.0" or importlib.util.find_spec("nixl") is None,
                                 reason=f"needs vLLM 0.34.0 and the NIXL wheels: {INSTALL}")]

PROMPT = tuple(range(1, 19))
"""Four full blocks and a partial one."""

KNOWN = "vllm-pd-NixlConnector-0.34.0.txt"


def hand_over(override: dict | None = None, size: int = 1) -> list[Call]:
    """Prefill one prompt on the producer and forward its params (with `override`) to the consumer; `run` drains."""
    config = EngineConfig(block_size=4, num_gpu_blocks=16, block_size_factor=1, tensor_parallel_size=size)
    return [Call("start", (config,)), Call("prefill", (RequestSpec(request_id="p", prompt=PROMPT),)),
            Call("step"), Call("step"),
            Call("decode", (RequestSpec(request_id="d", prompt=PROMPT, max_tokens=3), "p",
                            *([override] if override else [])))]


def test_a_prefill_read_by_the_consumer_is_conformant() -> None:
    """PD-PARAMS-1, PD-LOAD-1, PD-DATA-1, PD-HOLD-1, PD-NOTIFY-1: the consumer's blocks hold the producer's KV byte
    for byte after NIXL's read, and the producer frees its blocks on the notification."""
    assert run(VllmPDAdapter, hand_over()) is None


def test_a_malformed_forward_gets_a_per_clause_verdict_not_a_traceback() -> None:
    """Params naming blocks as a string the consumer cannot read are judged under a PD clause, never CONF-CALL-1."""
    violation = run(VllmPDAdapter, hand_over({"remote_block_ids": "not-held"}))
    assert violation is not None and violation.clause.startswith("PD-"), violation


def test_the_shipped_known_failures_are_each_classified() -> None:
    """Every entry of the shipped file says whether it is a bug of the release (file:line) or a design choice."""
    listed = baseline.load(resources.files("kvconform.adapters.vllm").joinpath("known-failures", KNOWN)).listed
    assert listed and all(entry.reason.split(":")[0] in ("bug", "design") for entry in listed)
