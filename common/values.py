"""The values of the adapter contract: what the harness asks an engine to do and what it observes (spec chapter
`adapter-contract`).

Every value that crosses the adapter boundary is a pydantic model, validated before it is compared (CONF-OBS-1).
Blocks are named by `BlockRef` — (request, offloaded block index) — never by implementation-specific hashes or
GPU block ids, so two implementations can be compared. The reference, the adapters and the kit all import them from
here, so the reference depends on no adapter code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator


class _Frozen(BaseModel):
    # revalidate_instances: an adapter may hand back a model built with `model_construct`, unvalidated (CONF-OBS-1)
    model_config = ConfigDict(frozen=True, extra="forbid", revalidate_instances="always")


class EngineConfig(_Frozen):
    """The engine an adapter must build: pool sizes, block geometry, policy and scheduling mode."""

    block_size: int = Field(4, ge=1, description="tokens per GPU block")
    num_gpu_blocks: int = Field(64, ge=2, description="GPU blocks, the null block 0 included")
    block_size_factor: int = Field(3, ge=1, description="GPU blocks per offloaded block")
    num_offload_blocks: int = Field(8, ge=1, description="offloaded blocks the store holds")
    eviction_policy: Literal["lru", "arc"] = "lru"
    async_scheduling: bool = False
    max_num_batched_tokens: int = Field(256, ge=1, description="token budget of one step")
    token_width: int = Field(8, ge=1, description="KV elements per token (layers x 2 x heads x head_dim)")
    kv_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    offer_at_finish: bool = Field(False, description="the step after a request finishes, offer its computed "
                                                     "blocks not stored yet (OFF-STORE-6)")
    flush_on_hit: bool = Field(False, description="also flush a store whose blocks become another request's "
                                                  "local hit (LIFE-FREE-2)")
    flush_all_on_preemption: bool = Field(False, description="a step that preempts flushes every transfer job in "
                                                             "flight, loads and other requests' stores included "
                                                             "(LIFE-FREE-2)")
    lookup_after_failed_load: bool = Field(True, description="look the store up again for a request one of whose "
                                                             "loads failed (LIFE-LOAD-4)")
    local_hit_after_failed_load: bool = Field(True, description="a request whose load failed keeps its local hit; "
                                                                "without it, it is admitted afresh (LIFE-LOAD-3)")
    restart_offers_on_lookup: bool = Field(False, description="each lookup of a request makes it offer its blocks "
                                                              "from the first one again (OFF-STORE-7)")
    arc_t1_fallback: bool = Field(False, description="with the arc policy, take a T1 victim where T1 is under its "
                                                     "target and T2 has none, rather than refuse the store "
                                                     "(OFF-ARC-4)")
    reset_forgets_stores: bool = Field(False, description="a connector reset forgets the store jobs it discards: an "
                                                          "unfinished request is answered at once rather than once "
                                                          "they are reported (CONN-MATCH-4)")
    defer_stores: bool = Field(False, description="the worker queues a step's stores and submits them at the start of "
                                                  "the next step, rather than after the step's forward (CONN-STEP-2)")
    tensor_parallel_size: int = Field(1, ge=1, exclude_if=lambda value: value == 1,
                                      description="tensor-parallel ranks per engine, each holding and moving only its "
                                                  "share of the KV heads (KVC-DATA-1, PD-TP-1): vLLM's "
                                                  "--tensor-parallel-size")

    def __repr__(self) -> str:
        return f"EngineConfig({', '.join(f'{k}={v!r}' for k, v in self.model_dump().items())})"


class RequestSpec(_Frozen):
    """A request as the harness submits it."""

    request_id: str
    prompt: tuple[int, ...] = Field(min_length=1)
    max_tokens: int = Field(1, ge=1)
    skip_reading_prefix_cache: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.model_dump().items()
                           if v != RequestSpec.model_fields[k].default)
        return f"RequestSpec({fields})"


class BlockRef(_Frozen):
    """Offloaded block `index` of request `request_id`: tokens `[index*B, (index+1)*B)`, B the offloaded block size."""

    request_id: str
    index: int = Field(ge=0)


class MatchAnswer(_Frozen):
    """One `get_num_new_matched_tokens` call: the local hit it was given and what it answered (CONN-MATCH-*)."""

    request_id: str
    local_hit_tokens: int = Field(ge=0)
    external_tokens: int | None = Field(description="the connector's count as it answered it; a negative one is a "
                                                    "fault the connector level judges (KVC-MATCH-1)")
    load_async: bool
    num_tokens: int | None = Field(None, ge=0, exclude_if=lambda value: value is None,  # scenarios written without it
                                   description="the request's tokens when it was asked (vLLM's `request.num_tokens`), "
                                               "where the adapter knows them: a synchronous load leaves the last to "
                                               "compute (KVC-MATCH-1)")


class LoadJob(_Frozen):
    """A load: offloaded blocks into the request's GPU blocks `first_gpu_block .. +num_gpu_blocks` (logical)."""

    request_id: str
    offload_indices: tuple[NonNegativeInt, ...]
    first_gpu_block: int = Field(ge=0)
    num_gpu_blocks: int = Field(ge=1)


class StoreJob(_Frozen):
    """Offloaded blocks of one request, offered to the store or written by it."""

    request_id: str
    offload_indices: tuple[NonNegativeInt, ...]
    evicted: tuple[BlockRef, ...] = Field((), description="for an offer: the blocks its prepare_store call evicted")


class TransferOutcome(_Frozen):
    """How the transfers in flight finish when they are completed: loads and/or stores may fail (CONN-STEP-4)."""

    fail_loads: bool = False
    fail_stores: bool = False


class RankReport(_Frozen):
    """What one tensor-parallel rank's worker reported in a step, before the engine aggregated the ranks (PD-TP-1):
    the request ids of its `KVConnectorOutput`."""

    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = Field((), description="receives of this rank that failed (vLLM: the ids of "
                                                            "`invalid_block_ids`' requests, or `failed_recving`)")


class EngineStep(_Frozen):
    """What one engine of a disaggregated pair did in a step, as its connector reported it (chapter `disaggregated`).

    Request ids are unique across the pair's engines; the engine's scheduler-level facts (scheduled and computed
    tokens, answers, finishes, frees) are in the step's `StepObservation` fields, the union of both engines'."""

    engine_id: str = Field(description="the engine's id, as its params name it (`remote_engine_id`)")
    ranks: tuple[RankReport, ...] = Field(description="each rank's report of the step, in rank order: "
                                                      "tensor_parallel_size of them (PD-TP-1)")
    finished_sending: tuple[str, ...] = Field((), description="delayed frees the engine saw ended in this step, once "
                                                              "every rank reported them (aggregated, PD-TP-1)")
    finished_recving: tuple[str, ...] = Field((), description="receives the engine saw finished in this step, once "
                                                              "every rank reported them (aggregated)")
    failed_recving: tuple[str, ...] = Field((), description="of those, the receives that failed (PD-FAIL-1)")
    params: dict[str, dict[str, Any] | None] = Field(default_factory=dict, description="each request that finished "
                                                     "in this step -> the kv_transfer_params its request_finished "
                                                     "returned, None for none (PD-PARAMS-1)")
    held: dict[str, tuple[NonNegativeInt, ...]] = Field(default_factory=dict, description="after the step, each "
                                                        "finished request whose free the connector still delays -> "
                                                        "the GPU block ids it holds, as the engine's block table has "
                                                        "them (PD-HOLD-1)")
    forward_writes: frozenset[NonNegativeInt] = Field(frozenset(), description="physical GPU blocks this engine's "
                                                                               "forward wrote in the step")


class DisaggregatedStep(_Frozen):
    """One step of a disaggregated pair: each engine's connector facts (chapter `disaggregated`)."""

    producer: EngineStep
    consumer: EngineStep


class StepObservation(_Frozen):
    """Everything one engine step did that the spec constrains."""

    scheduled_tokens: dict[str, NonNegativeInt] = Field(description="tokens scheduled for each request in this step "
                                                                    "(SCHED-STEP-2)")
    computed_tokens: dict[str, NonNegativeInt] = Field(description="num_computed_tokens of every unfinished request "
                                                                   "after the step")
    match_answers: tuple[MatchAnswer, ...] = Field((), description="every get_num_new_matched_tokens call of the step, "
                                                                   "in order")
    masked_answers: tuple[MatchAnswer, ...] = Field((), description="the answers of `match_answers` that the engine's "
                                                                    "scheduler replaced before using them, as the "
                                                                    "connector gave them (a skip-read request's, on a "
                                                                    "release that answers it itself)")
    lookups: dict[str, tuple[NonNegativeInt, ...]] = Field(default_factory=dict, description="offloaded block indices "
                                                                                             "looked up, in order")
    loads: tuple[LoadJob, ...] = Field((), description="load jobs created in this step (CONN-ALLOC-1)")
    store_offers: tuple[StoreJob, ...] = Field((), description="blocks offered to prepare_store, per request "
                                                               "(OFF-STORE-1)")
    stores: tuple[StoreJob, ...] = Field((), description="blocks prepare_store chose to write: the store jobs "
                                                         "(OFF-STORE-3)")
    evicted: tuple[BlockRef, ...] = Field((), description="blocks the store evicted in this step (OFF-LRU-1, "
                                                          "OFF-ARC-1)")
    preempted: tuple[str, ...] = Field((), description="running requests the scheduler preempted in this step to make "
                                                       "room (SCHED-PREEMPT-1)")
    promoted: dict[str, NonNegativeInt] = Field(default_factory=dict, description="waiting requests whose finished "
                                                "load the scheduler took up in this step, scheduled or not (their "
                                                "loaded blocks cached, or freed after a failure: LIFE-LOAD-1, "
                                                "LIFE-LOAD-3), in order, each with the number of match_answers the "
                                                "step had given before: its place in the order the scheduler "
                                                "considered waiting requests (SCHED-ORDER-1)")
    finished: tuple[str, ...] = Field((), description="requests that finished in this step (LIFE-FIN-1)")
    freed: tuple[str, ...] = Field((), description="requests whose GPU blocks were released in this step")
    forward_writes: frozenset[NonNegativeInt] = Field(frozenset(), description="physical GPU blocks the forward wrote")
    store_reads_in_flight: frozenset[NonNegativeInt] = Field(frozenset(), description="physical GPU blocks in-flight "
                                                                                       "stores read during the forward")
    output_tokens: dict[str, tuple[NonNegativeInt, ...]] = Field(
        default_factory=dict, description="each request whose output grew in this step -> all its output tokens so "
                                          "far, where the engine's own model sampled them (a recorded real engine): "
                                          "the judge's KV history takes them in place of the kit's model's "
                                          "(KVC-HIT-1); empty where the kit's model decodes")
    # The offloading level: the manager calls of the step, as vLLM's OffloadingManager receives them.
    completed_loads: tuple[LoadJob, ...] = Field((), description="load jobs whose completion was processed in this "
                                                               "step (complete_load, OFF-MGR-3); each job of `loads` "
                                                               "once, unless a connector reset discarded it "
                                                               "(CONN-STEP-4)")
    completed_stores: tuple[StoreJob, ...] = Field((), description="store jobs whose completion was processed in "
                                                                 "this step, successful or not (complete_store); each "
                                                                 "job of `stores` once, unless a connector reset "
                                                                 "discarded it (CONN-STEP-4)")
    flushed_stores: tuple[StoreJob, ...] = Field((), description="store jobs flushed (waited for) in this step "
                                                               "(LIFE-FREE-2, OFF-MGR-8)")
    touches: tuple[BlockRef, ...] = Field((), description="blocks touched in the store in this step, in order, "
                                                          "named by the touching request (OFF-LRU-1)")
    # The connector level (chapter `connector-level`): what crosses vLLM's public connector API, per request.
    loads_finished: tuple[str, ...] = Field((), description="requests whose asynchronous load the connector reported "
                                                            "finished in this step (get_finished's receiving ids)")
    loads_failed: tuple[str, ...] = Field((), description="requests the connector reported load errors for in this "
                                                          "step (get_block_ids_with_load_errors, or the "
                                                          "transfer results' failed_recving)")
    free_delayed: tuple[str, ...] = Field((), description="requests whose request_finished answered delay_free=True "
                                                          "in this step")
    saves_finished: tuple[str, ...] = Field((), description="requests whose delayed free the connector ended in this "
                                                            "step (get_finished's sending ids)")
    # The disaggregated level (chapter `disaggregated`): a pair's step is both engines' step; the fields above are the
    # union of the two engines' (request ids are unique across them), this one each engine's connector facts.
    # The events level (chapter `kv-events`): what the engine published for KV-aware routers in this step.
    kv_events: tuple[Any, ...] = Field((), exclude_if=lambda value: not value,
                                       description="the KV events the engine published in this step, in order: one "
                                                   "batch, each event a mapping with its `type` "
                                                   "(`kvconform.common.kv_events`), parsed by the judge "
                                                   "(EVT-FORMAT-1); empty from an adapter not of the events level")
    disaggregated: DisaggregatedStep | None = Field(None, exclude_if=lambda value: value is None,
                                                    description="each engine's connector facts, from an adapter "
                                                                "of the disaggregated level; None from any other")


class StoreSnapshot(_Frozen):
    """The offload store's contents: readable blocks and blocks still being stored."""

    ready: frozenset[BlockRef]
    storing: frozenset[BlockRef]


class ResourceUsage(_Frozen):
    """Counters that must return to zero when the engine is idle (LIFE-LEAK-1)."""

    used_gpu_blocks: int = Field(ge=0, description="GPU blocks referenced by any request (null block excluded)")
    pinned_offload_blocks: int = Field(ge=0)
    jobs_in_flight: int = Field(ge=0)
    unfinished_requests: int = Field(ge=0)


SpecLevel = Literal["connector", "offloading", "disaggregated", "events"]
"""The levels of the spec: what every KVConnectorBase_V1 must do (`connector`), and the deeper rules of
OffloadingManager-style connectors (`offloading`); an adapter that reports the offloading level's observations
is judged at both. `disaggregated` (chapter 09, P/D connectors): an adapter of a producer/consumer pair of engines
(`KVConnectorAdapter.prefill`, `decode`, `StepObservation.disaggregated`) is judged at this level alone, as the pair
is not one engine. `events` (chapter 10): an adapter that reports the KV events its engine publishes
(`StepObservation.kv_events`) is judged on them too; one that publishes none leaves it out."""

VARIANTS = ("offer_at_finish", "flush_on_hit", "flush_all_on_preemption", "lookup_after_failed_load",
            "local_hit_after_failed_load", "restart_offers_on_lookup", "arc_t1_fallback", "defer_stores",
            "reset_forgets_stores")
"""EngineConfig fields that name a behaviour of the connector and the store that releases of one implementation
differ in: the capability of the same name lists the values an implementation has, and the reference follows the
value the config carries. A choice of the scheduler is no variant: the judge follows the schedule it observes."""


class Capabilities(_Frozen):
    """What an implementation claims to support; the harness draws only from this (CONF-CAP-1)."""

    async_scheduling: bool = Field(True, description="runs with async scheduling as well as sync")
    eviction_policies: tuple[Literal["lru", "arc"], ...] = Field(("lru", "arc"), description="store eviction policies "
                                                                                            "it implements")
    block_size_factors: tuple[int, ...] = Field((1, 2, 3), description="GPU blocks per offloaded block it supports")
    preemption: bool = Field(True, description="preempt() of a running request is supported")
    abort: bool = Field(True, description="abort() of an unfinished request is supported")
    transfer_failures: bool = Field(True, description="complete_transfers() can fail loads and stores")
    reset_connector: bool = Field(True, description="reset_prefix_cache(reset_connector=True) also empties the store")
    offer_at_finish: tuple[bool, ...] = Field((False,), description="whether the connector offers a finished "
                                                                      "request's blocks at the next step (OFF-STORE-6)")
    flush_on_hit: tuple[bool, ...] = Field((False,), description="whether a store is also flushed when its blocks "
                                                                   "become a local hit (LIFE-FREE-2)")
    flush_all_on_preemption: tuple[bool, ...] = Field((False,), description="whether a step that preempts flushes "
                                                                              "every transfer job in flight "
                                                                              "(LIFE-FREE-2)")
    lookup_after_failed_load: tuple[bool, ...] = Field((True,), description="whether a request whose load failed is "
                                                                              "looked up again (LIFE-LOAD-4)")
    local_hit_after_failed_load: tuple[bool, ...] = Field((True,), description="whether a request whose load failed "
                                                                                 "keeps its local hit (LIFE-LOAD-3)")
    restart_offers_on_lookup: tuple[bool, ...] = Field((False,), description="whether each lookup of a request makes "
                                                                               "it offer its blocks from the first one "
                                                                               "again (OFF-STORE-7)")
    arc_t1_fallback: tuple[bool, ...] = Field((False,), description="whether the arc policy takes a T1 victim where T1 "
                                                                      "is under its target and T2 has none "
                                                                      "(OFF-ARC-4)")
    reset_forgets_stores: tuple[bool, ...] = Field((False,), description="whether a connector reset forgets the "
                                                                           "store jobs it discards (CONN-MATCH-4)")
    defer_stores: tuple[bool, ...] = Field((False,), description="whether the worker submits a step's stores at the "
                                                                   "start of the next step (CONN-STEP-2)")
    harness_completes_transfers: bool = Field(True, description="transfers finish when the harness completes "
                                                                 "them (a seam holds them), so the adapter is "
                                                                 "deterministic; False for a connector on its own "
                                                                 "clock, whose threads finish them: the harness steps "
                                                                 "it until idle or a deadline (KVC-ASYNC-1, "
                                                                 "KVC-LIVE-1)")
    complete_in_step: bool = Field(False, description="step(complete_transfers=…) finishes the transfers in flight "
                                                      "inside the step, where the worker polls its jobs")
    never: tuple[Literal["delays_free", "fails_load"], ...] = Field((), description="what the connector's design "
                                                                                    "never does, as its manifest "
                                                                                    "declares: verified at run time "
                                                                                    "(KVC-FREE-1, KVC-FAIL-1), and "
                                                                                    "the clauses it rules out are not "
                                                                                    "applicable to --certify "
                                                                                    "(CONF-CERT-1)")
    levels: tuple[SpecLevel, ...] = Field(("connector", "offloading"), description="the spec levels whose "
                                                                                 "observations it reports")
    kv_cache_groups: int = Field(1, description="KV-cache groups; the spec covers one")
    reads_kv: bool = Field(True, description="computed_kv() returns the GPU bytes, so data integrity is checked")
    reads_stored_kv: bool = Field(False, description="stored_kv() returns the bytes the store holds for a readable "
                                                     "offloaded block, so the data at rest is checked (XFER-DATA-3)")
    tensor_parallel_sizes: tuple[int, ...] = Field((1,), description="tensor_parallel_size values it runs, "
                                                                     "one drawn per example unless the run names one "
                                                                     "(KVC-DATA-1, PD-TP-1)")
    lease_steps: int | None = Field(None, ge=1, description="disaggregated level: a producer's delayed free ends "
                                                            "after this many producer steps with no read (the harness "
                                                            "clock, PD-LEASE-1)")
    lease_seconds: float | None = Field(None, gt=0, description="disaggregated level: a producer's delayed free ends "
                                                                "this many seconds after its request finished, with no "
                                                                "read (the connector's own clock: vLLM NIXL's "
                                                                "kv_lease_duration, PD-LEASE-1)")

    def lacks(self, config: EngineConfig) -> str | None:
        """Return what `config` asks that these capabilities do not offer — a factor, policy, scheduling mode or
        behaviour variant — or None if they offer all of it (CONF-CAP-1)."""
        wanted = {"block_size_factors": config.block_size_factor, "eviction_policies": config.eviction_policy,
                  **{variant: getattr(config, variant) for variant in VARIANTS}}
        for capability, value in wanted.items():
            if value not in getattr(self, capability):
                return f"{capability} {getattr(self, capability)}, not {value!r}"
        if config.async_scheduling and not self.async_scheduling:
            return "sync scheduling only, not async"
        if config.tensor_parallel_size not in self.tensor_parallel_sizes:
            return f"tensor_parallel_sizes {self.tensor_parallel_sizes}, not {config.tensor_parallel_size}"
        return None

    @model_validator(mode="after")
    def _consistent(self) -> Capabilities:
        if not all((self.eviction_policies, self.block_size_factors, *(getattr(self, v) for v in VARIANTS))):
            raise ValueError(f"capabilities must list at least one eviction policy, block_size_factor and value of "
                             f"each of {', '.join(VARIANTS)}")
        if any(factor < 1 for factor in self.block_size_factors):
            raise ValueError("block_size_factors must be >= 1")
        if not self.tensor_parallel_sizes or any(size < 1 for size in self.tensor_parallel_sizes):
            raise ValueError("tensor_parallel_sizes must list sizes >= 1")
        if "disaggregated" in self.levels and (self.lease_steps is None) == (self.lease_seconds is None):
            raise ValueError("an adapter of the disaggregated level gives its lease in lease_steps or lease_seconds, "
                             "one of them")
        return self
