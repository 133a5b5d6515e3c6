"""The offloading level is judged on the adapter's own schedule: the reference follows it (SCHED-STEP-2).

`schedule_of` reads the scheduling choices out of a step's observation; the reference engine follows them; an
adapter whose scheduler chooses otherwise than the reference's own policy, within the SCHED clauses, conforms.
"""

from __future__ import annotations

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import EngineConfig, MatchAnswer, RequestSpec, StepObservation
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.judging.offloading import schedule_of
from kvconform.reference.engine import Engine, OwnPolicy

PROMPT = (2,) * 8 + (3, 1, 0, 0)
LONG_PROMPT = (0, 2) * 23 + (0, 1)


def answer(request_id: str, external: int | None, load_async: bool = False) -> MatchAnswer:
    return MatchAnswer(request_id=request_id, local_hit_tokens=0, external_tokens=external, load_async=load_async)


def test_schedule_of_places_requests_taken_up_after_a_load_where_they_were_considered():
    """A request taken up after its load in this step is placed after the answers given before it, scheduled or
    not; one scheduled that was neither asked nor taken up had been taken up earlier and holds its blocks: first."""
    observation = StepObservation(scheduled_tokens={"running": 1, "resumed": 4, "admitted": 8},
                                  computed_tokens={"running": 9, "resumed": 12, "loaded": 12, "admitted": 8,
                                                   "deferred": 0},
                                  match_answers=(answer("deferred", None), answer("admitted", 0)),
                                  promoted={"loaded": 1})
    followed = schedule_of(observation, running=["running"])
    assert followed.considered == ("resumed", "deferred", "loaded", "admitted")
    assert followed.admitted == {"resumed", "admitted"}


def test_schedule_of_counts_an_admission_with_a_load():
    """A request answered with an asynchronous load is admitted if the step left it computed tokens; one the
    scheduler could not fit keeps none."""
    observation = StepObservation(scheduled_tokens={}, computed_tokens={"loading": 8, "unfit": 0},
                                  match_answers=(answer("loading", 8, True), answer("unfit", 8, True)))
    assert schedule_of(observation, running=[]).admitted == {"loading"}


class DeferredFirstEngine(Engine):
    """vLLM 0.23 and 0.24's order: a request whose lookup was deferred is considered right after the block holders,
    before the other waiting requests (they wait together in `skipped_waiting`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deferred_at: dict[str, int] = {}
        ask = self.connector.get_num_new_matched_tokens

        def asking(request, num_local, deviations):
            tokens, load_async = ask(request, num_local, deviations)
            if tokens is None:
                self.deferred_at.setdefault(request.request_id, len(self.deferred_at))
            return tokens, load_async

        self.connector.get_num_new_matched_tokens = asking

    def order_waiting(self) -> None:
        def rank(request) -> tuple[int, int]:
            if request.request_id in self.holders:
                return 0, self.holders[request.request_id]
            return (1, self.deferred_at[request.request_id]) if request.request_id in self.deferred_at else (2, 0)

        self.waiting.sort(key=rank)


class KeepsInFlightRequestEngine(Engine):
    """vLLM 0.34's `_request_blocks_can_be_freed`: a request whose step is still in flight is not preempted for room;
    scheduling of running requests stops there instead."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy = KeepsInFlightRequestPolicy(self)


class KeepsInFlightRequestPolicy(OwnPolicy):
    """The reference's policy, but no victim whose step is still in flight on `engine`."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def victim(self, running, request):
        victim = running[-1]
        return None if self.engine.last_scheduled.get(victim.request_id, 0) > self.engine.processed_steps else victim


class RecordingAdapter(ReferenceAdapter):
    """The reference adapter over a given engine, keeping what each step observed."""

    steps: list[StepObservation]

    def start(self, config: EngineConfig) -> None:
        super().start(config)
        self.steps = []

    def step(self, complete_transfers=None) -> StepObservation:
        self.steps.append(super().step(complete_transfers))
        return self.steps[-1]

    def asked(self) -> list[list[str]]:
        """Return, per step that asked two requests or more, the requests asked for matches, in order."""
        return [[a.request_id for a in step.match_answers] for step in self.steps if len(step.match_answers) > 1]



def run_followed(engine: type[Engine], program: list[Call]) -> tuple[RecordingAdapter, RecordingAdapter,
                                                                     ClauseViolation | None]:
    """Run `program` on the reference and on a variant engine judged by the kit; return both adapters and the
    variant's violation, if any."""
    own, variant = RecordingAdapter(), RecordingAdapter(engine=engine)
    assert replay(Session(lambda: own), program).violation is None
    return own, variant, replay(Session(lambda: variant), program).violation


def add(**spec) -> Call:
    return Call("add_request", (RequestSpec(**spec),))


def test_a_deferred_request_considered_first_is_judged_on_its_own_order():
    """SCHED-ORDER-1 lets a request whose lookup was deferred be considered before a request preempted later (vLLM
    0.24) or after it (the reference, vLLM 0.34): the judge follows either order and finds no fault in it."""
    program = [Call("start", (EngineConfig(num_gpu_blocks=64, block_size_factor=3, num_offload_blocks=2,
                                           max_num_batched_tokens=16),)),
               add(request_id="writer", prompt=PROMPT + (1, 0, 1), max_tokens=2),
               add(request_id="short", prompt=(0, 2) * 4, max_tokens=3),
               add(request_id="long_writer", prompt=LONG_PROMPT, lora_name="lora-x"), Call("drain"),
               Call("reset_prefix_cache", (False,)), add(request_id="runner", prompt=(3,) * 5, max_tokens=8),
               add(request_id="first", prompt=PROMPT), add(request_id="deferred", prompt=PROMPT),
               add(request_id="last", prompt=LONG_PROMPT[:24] + (3, 3, 3), lora_name="lora-x"),
               Call("step"), Call("preempt", ("runner",)), Call("step"), Call("step"), Call("drain")]
    own, variant, violation = run_followed(DeferredFirstEngine, program)
    assert (own.asked()[-1], variant.asked()[-1]) == (["runner", "deferred"], ["deferred", "runner"])
    assert violation is None


def test_a_request_kept_while_its_step_is_in_flight_is_judged_on_its_own_schedule():
    """SCHED-PREEMPT-1 lets a scheduler stop rather than preempt a request whose step is in flight (vLLM 0.34): the
    judge follows the schedule with the request kept, where the reference's own policy preempts it."""
    program = [Call("start", (EngineConfig(num_gpu_blocks=5, block_size_factor=1, async_scheduling=True),)),
               add(request_id="a", prompt=PROMPT[:8], max_tokens=3),
               add(request_id="b", prompt=PROMPT[:8], max_tokens=3), Call("step"), Call("step"), Call("drain")]
    own, variant, violation = run_followed(KeepsInFlightRequestEngine, program)
    assert (own.steps[1].preempted, variant.steps[1].preempted) == (("b",), ())
    assert violation is None


class LeavesLoadedRequestWaitingEngine(Engine):
    """vLLM 0.34's `_handle_blocked_waiting_request`: a finished load is taken up (its blocks cached) when the
    scheduler considers the request, which may then stay waiting in that step (no running slot, or no room)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken_up: set[str] = set()
        holds = self.kv.holds_sequence

        def holds_unless_taken_up(request, blocks) -> bool:
            return request.request_id not in self.taken_up and holds(request, blocks)

        self.kv.holds_sequence = holds_unless_taken_up

    def _schedule(self, step):
        self.taken_up.clear()
        return super()._schedule(step)

    def _finish_load(self, request, success) -> None:
        super()._finish_load(request, success)
        self.taken_up.add(request.request_id)


def test_a_load_taken_up_without_running_is_judged_on_its_cached_blocks():
    """LIFE-LOAD-1, PFX-HIT-1: a request whose finished load the scheduler took up, caching its blocks, but left
    waiting (`promoted`, not scheduled) and then aborted leaves those blocks cached; the judge takes the load up in
    the same step, so a later request's local hit on them is no fault (`--profile dev --seed 5` on vLLM 0.34.0)."""
    program = [Call("start", (EngineConfig(num_gpu_blocks=16, block_size_factor=1, num_offload_blocks=8),)),
               add(request_id="writer", prompt=PROMPT), Call("drain"), Call("reset_prefix_cache", (False,)),
               add(request_id="reader", prompt=PROMPT), Call("step"), Call("complete_transfers", (False, False)),
               Call("step"), Call("step"), Call("abort", ("reader",)), add(request_id="hitter", prompt=PROMPT),
               Call("step"), Call("drain")]
    own, variant, violation = run_followed(LeavesLoadedRequestWaitingEngine, program)
    assert violation is None, violation
    taken_up = [step for step in variant.steps if "reader" in step.promoted]
    assert taken_up and "reader" not in taken_up[0].scheduled_tokens
    hits = [a.local_hit_tokens for step in variant.steps for a in step.match_answers if a.request_id == "hitter"]
    assert hits and hits[0] > 0
