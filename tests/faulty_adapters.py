"""Faulty adapters: the reference adapter with one call made to misbehave after a few correct answers.

Each fault class is one way untrusted adapter code goes wrong — it raises, exits, hangs, returns the
wrong type, or returns out-of-range values. The kit must turn every one into a named clause failure
(CONF-CALL-1, CONF-CALL-2, CONF-OBS-1, CONF-OBS-2, …), never crash, hang or pass.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from kvconform.adapters.contract import ImplementationFailure
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import (
    BlockRef,
    Capabilities,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    StoreJob,
    TransferOutcome,
)
from kvconform.conformance.mutants import black_box


def faulty(operation: str, fault: Callable[[Any], Any], after: int = 2) -> type[ReferenceAdapter]:
    """Return a reference adapter whose `operation` answers correctly `after` times, then returns `fault(answer)`."""

    def misbehaving(self: ReferenceAdapter, *args: Any) -> Any:
        answer = getattr(ReferenceAdapter, operation)(self, *args)
        self.answered[operation] = self.answered.get(operation, 0) + 1
        return answer if self.answered[operation] <= after else fault(answer)

    def __init__(self: ReferenceAdapter) -> None:
        ReferenceAdapter.__init__(self)
        self.answered: dict[str, int] = {}

    return type(f"Faulty_{operation}", (ReferenceAdapter,), {"__init__": __init__, operation: misbehaving})


def raising(answer: Any) -> Any:
    raise RuntimeError("adapter bug")


def exiting(answer: Any) -> Any:
    sys.exit(3)


def hanging(answer: Any) -> Any:
    time.sleep(3600)


def negative_tokens(observation: StepObservation) -> StepObservation:
    return StepObservation.model_construct(**{**dict(observation), "scheduled_tokens": {"r0": -1}})


def unknown_request(observation: StepObservation) -> StepObservation:
    return observation.model_copy(update={"scheduled_tokens": {**observation.scheduled_tokens, "ghost": 4}})


def store_of_missing_block(observation: StepObservation) -> StepObservation:
    ghost = StoreJob(request_id=next(iter(observation.computed_tokens), "r0"), offload_indices=(99,))
    return observation.model_copy(update={"stores": (*observation.stores, ghost)})


def negative_usage(usage: ResourceUsage) -> ResourceUsage:
    return ResourceUsage.model_construct(**{**dict(usage), "used_gpu_blocks": -1})


def evicted_unknown(observation: StepObservation) -> StepObservation:
    return observation.model_copy(update={"evicted": (BlockRef(request_id="ghost", index=0),)})


def answers_past_prompt(observation: StepObservation) -> StepObservation:
    answers = tuple(answer.model_copy(update={"external_tokens": 10_000, "load_async": True})
                    for answer in observation.match_answers)
    return observation.model_copy(update={"match_answers": answers})


def unfinished_forever(usage: ResourceUsage) -> ResourceUsage:
    return usage.model_copy(update={"unfinished_requests": usage.unfinished_requests + 1})


class AnswersSkipReadRequests(ReferenceAdapter):
    """Reports a 4-token asynchronous hit for every skip-read request it is asked about, without looking it up."""

    def add_request(self, request: RequestSpec) -> None:
        super().add_request(request)
        if request.skip_reading_prefix_cache:
            self.skipping = getattr(self, "skipping", set()) | {request.request_id}

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        observation = super().step(complete_transfers)
        answers = tuple(a.model_copy(update={"external_tokens": 4, "load_async": True})
                        if a.request_id in getattr(self, "skipping", set()) else a for a in observation.match_answers)
        return observation.model_copy(update={"match_answers": answers})


def answers_a_synchronous_full_hit(masked: bool) -> type[ReferenceAdapter]:
    """Return the black-box reference adapter whose connector answers every hit as a synchronous load of all of its
    request's tokens (KVC-MATCH-1; its requests are fresh, so their tokens are their prompts). With `masked` its
    engine's scheduler replaces that answer by the reference's own before using it, and reports both; without, the
    engine takes it as given."""

    def add_request(self: ReferenceAdapter, request: RequestSpec) -> None:
        ReferenceAdapter.add_request(self, request)
        self.prompts = {**getattr(self, "prompts", {}), request.request_id: len(request.prompt)}

    def step(self: ReferenceAdapter) -> StepObservation:
        observation = ReferenceAdapter.step(self)
        taken = tuple(answer.model_copy(update={"num_tokens": self.prompts[answer.request_id]})
                      for answer in observation.match_answers)
        given = tuple(answer.model_copy(update={"external_tokens": answer.num_tokens - answer.local_hit_tokens,
                                                "load_async": False}) if answer.external_tokens else answer
                      for answer in taken)
        if not masked:
            return observation.model_copy(update={"match_answers": given})
        replaced = tuple(answer for answer in given if answer not in taken)
        return observation.model_copy(update={"match_answers": taken, "masked_answers": replaced})

    return black_box(type(f"SynchronousFullHit{'Masked' * masked}", (ReferenceAdapter,),
                          {"add_request": add_request, "step": step}))


FAULTS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "step-raises": (faulty("step", raising), "CONF-CALL-1", "adapter.step()"),
    "step-exits": (faulty("step", exiting), "CONF-CALL-1", "adapter.step()"),
    "start-raises": (faulty("start", raising, after=0), "CONF-CALL-1", "adapter.start("),
    "close-raises": (faulty("close", raising, after=0), "CONF-CALL-1", "adapter.close()"),
    "step-returns-dict": (faulty("step", lambda o: o.model_dump()), "CONF-OBS-1", "adapter.step()"),
    "step-returns-none": (faulty("step", lambda o: None), "CONF-OBS-1", "adapter.step()"),
    "event-of-unknown-type": (faulty("step", lambda o: o.model_copy(update={
        "kv_events": (*o.kv_events, {"type": "BlockEvicted", "block_hashes": ["ab" * 16]})})),
        "EVT-FORMAT-1", "unknown event type 'BlockEvicted'"),
    "removal-never-announced": (faulty("step", lambda o: o.model_copy(update={
        "kv_events": (*o.kv_events, {"type": "BlockRemoved", "block_hashes": ["ab" * 16], "medium": "CPU"})})),
        "EVT-ORDER-1", "not announced there"),
    "step-negative-tokens": (faulty("step", negative_tokens), "CONF-OBS-1", "scheduled_tokens"),
    "step-unknown-request": (faulty("step", unknown_request), "SCHED-STEP-2", "adapter.step(): scheduled tokens"),
    "step-stores-missing-block": (faulty("step", store_of_missing_block), "OFF-STORE-2", "adapter.step(): StoreJob"),
    "step-evicts-unknown-request": (faulty("step", evicted_unknown), "CONF-OBS-2",
                                    "adapter.step(): BlockRef(request_id='ghost'"),
    "store-contents-list": (faulty("store_contents", lambda snapshot: list(snapshot.ready)), "CONF-OBS-1",
                            "adapter.store_contents()"),
    "resource-usage-negative": (faulty("resource_usage", negative_usage, after=0), "CONF-OBS-1", "used_gpu_blocks"),
    "computed-kv-float32": (faulty("computed_kv", lambda kv: kv.float(), after=0), "CONF-OBS-1", "torch.float32"),
    "computed-kv-narrow": (faulty("computed_kv", lambda kv: kv[:, :-1], after=0), "CONF-OBS-1", "width"),
    "computed-kv-list": (faulty("computed_kv", lambda kv: kv.tolist(), after=0), "CONF-OBS-1", "returned list"),
    "reset-returns-int": (faulty("reset_prefix_cache", int, after=0), "CONF-OBS-1", "adapter.reset_prefix_cache("),
    "capabilities-inconsistent": (
        faulty("capabilities", lambda c: Capabilities.model_construct(**{**dict(c), "eviction_policies": ()}), after=0),
        "CONF-OBS-1", "at least one eviction policy"),
    "step-answers-past-prompt": (faulty("step", answers_past_prompt, after=0), "CONN-MATCH-3", "exceeds the request's"),
    "skip-read-answered": (AnswersSkipReadRequests, "OFF-READ-2", "skip-read request answered"),
    "resource-usage-unfinished": (faulty("resource_usage", unfinished_forever, after=0), "LIFE-LIVE-1",
                                  "still unfinished"),
    "black-box-unfinished": (black_box(faulty("resource_usage", unfinished_forever, after=0)), "KVC-LIVE-1",
                             "still unfinished"),
    "step-hangs": (faulty("step", hanging), "CONF-CALL-2", "adapter.step()"),
    "store-contents-hangs": (faulty("store_contents", hanging), "CONF-CALL-2", "adapter.store_contents()"),
}
"""Fault class → (adapter factory, the clause the kit must report, text the failure message must contain)."""


def factory_raising() -> ReferenceAdapter:
    raise RuntimeError("cannot connect to the store")


class SlowAdapter(ReferenceAdapter):
    """Correct but slow: long enough runs for the Ctrl-C test to interrupt one."""

    def step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        time.sleep(0.02)
        return super().step(complete_transfers)


class SyncOnlyAdapter(ReferenceAdapter):
    """Declares no async scheduling: asking for an async-only run of it is a usage error."""

    def capabilities(self) -> Capabilities:
        return Capabilities(async_scheduling=False)


inconsistent_manifest = FAULTS["capabilities-inconsistent"][0]
hangs_in_step = FAULTS["step-hangs"][0]


def failing_reset(recovered: bool) -> type[ReferenceAdapter]:
    """Return a reference adapter whose connector resets report that the implementation failed OFF-MGR-8 after
    resetting the prefix cache alone, as vLLM 0.30's does; the class counts the steps its instances are asked for
    after such a failure."""

    def reset_prefix_cache(self: ReferenceAdapter, reset_connector: bool) -> bool:
        result = ReferenceAdapter.reset_prefix_cache(self, False)
        if reset_connector:
            self.failed = True
            raise ImplementationFailure("OFF-MGR-8", "the connector reset failed", recovered=recovered, result=result)
        return result

    def step(self: ReferenceAdapter, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        if getattr(self, "failed", False):
            type(self).steps_after_failure += 1
        return ReferenceAdapter.step(self, complete_transfers)

    return type(f"FailingReset_{recovered}", (ReferenceAdapter,),
                {"reset_prefix_cache": reset_prefix_cache, "step": step, "steps_after_failure": 0})
