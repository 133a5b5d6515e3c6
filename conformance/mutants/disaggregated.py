"""Mutants of the disaggregated level: the reference P/D pair with one real P/D failure put back (chapter
`disaggregated`). Each names the issue or PR, in vLLM's tracker or a vendor's, where the failure was seen; each is
a reference-pd adapter whose producer or consumer connector is the mutant's, judged at the disaggregated level."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvconform.adapters.reference_pd import ReferencePDAdapter
from kvconform.reference.disaggregated import (
    Aggregator,
    ConsumerConnector,
    ProducerConnector,
    RankOutput,
    heads,
)


def pair_adapter(part: type) -> type[ReferencePDAdapter]:
    """Return a reference-pd adapter, named after the mutant part, whose producer or consumer connector is it."""
    producer = part if issubclass(part, ProducerConnector) else ProducerConnector
    consumer = part if issubclass(part, ConsumerConnector) else ConsumerConnector

    def __init__(self: ReferencePDAdapter) -> None:
        ReferencePDAdapter.__init__(self, producer=producer, consumer=consumer)

    return type(f"{part.__name__}Adapter", (ReferencePDAdapter,), {"__init__": __init__})


# --- the producer ----------------------------------------------------------------------------------------


class ReleasesBeforeReadProducer(ProducerConnector):
    """A lease shorter than the hold: the producer frees a finished request's blocks at its next step, before the
    consumer read them, and the consumer may read reused blocks (aws-samples/aws-do-eks#84: NixlConnector's 30 s
    `kv_lease_duration` shorter than the hold; 8 of 42 requests served on KV blocks the prefill had released)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_steps = 1


class LeaseNeverEndsProducer(ProducerConnector):
    """A hold no consumer reads is never released: the blocks stay stranded (vLLM PR #20139, the TTL on P's blocks;
    PR #41269, blocks stranded when D never opens the transfer)."""

    def request_finished(self, request_id: str, block_ids: list[int], params: dict[str, Any] | None,
                         finished_normally: bool) -> tuple[bool, dict[str, Any] | None]:
        delay, returned = super().request_finished(request_id, block_ids, params, finished_normally)
        if delay:
            self.held[request_id].expires = 1 << 62
        return delay, returned


class WrongRemoteBlocksProducer(ProducerConnector):
    """Params naming other blocks than those held, shifted by one (vLLM PR #52232: HMA `remote_block_ids` that are
    not group-qualified name other blocks than the producer's)."""

    def request_finished(self, request_id: str, block_ids: list[int], params: dict[str, Any] | None,
                         finished_normally: bool) -> tuple[bool, dict[str, Any] | None]:
        delay, returned = super().request_finished(request_id, block_ids, params, finished_normally)
        if returned is not None:
            returned["remote_block_ids"] = [block + 1 for block in block_ids]
        return delay, returned


class HoldsAbortedProducer(ProducerConnector):
    """An aborted producer request still delays its free, though no consumer will read it (vLLM's NIXL
    `request_finished`: "a P/D prefill request with immediate block free (eg abort)"; PR #25067)."""

    def request_finished(self, request_id: str, block_ids: list[int], params: dict[str, Any] | None,
                         finished_normally: bool) -> tuple[bool, dict[str, Any] | None]:
        return super().request_finished(request_id, block_ids, params, True)


# --- the consumer ----------------------------------------------------------------------------------------


class ReportsReceiveTwiceConsumer(ConsumerConnector):
    """Reports a finished receive again at the next step (vLLM PR #25067: a second report of a finished transfer
    reached the scheduler, `KeyError` in `_update_from_kv_xfer_finished`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.again: set[str] = set()

    def get_finished(self) -> RankOutput:
        done = super().get_finished()
        again, self.again = self.again, set(done.finished_recving)
        done.finished_recving |= again
        return done

    def reports_pending(self) -> bool:
        return super().reports_pending() or bool(self.again)


class NeverReportsConsumer(ConsumerConnector):
    """Its reads never complete, so no rank ever reports them: the request waits for remote KV forever (vLLM #35943,
    Mooncake: D-side requests stuck in WAITING_FOR_REMOTE_KVS on a failed transfer, their blocks never freed)."""

    def complete_transfers(self, fail: bool) -> None:
        """Leave every read in flight."""


class LosesNotificationConsumer(ConsumerConnector):
    """Reads the producer's blocks but its notification is lost: the producer holds them until the lease (vLLM
    #46283: a notification lost and blocks never reclaimed; PR #41269)."""

    def complete_transfers(self, fail: bool) -> None:
        kept = {engine: list(pending) for engine, pending in self.transport.notifications.items()}
        super().complete_transfers(fail)
        self.transport.notifications.update(kept)


class AcceptsMalformedParamsConsumer(ConsumerConnector):
    """Answers a remote load to params that ask one and name blocks, whatever else they lack (NixlConnectorScheduler.
    get_num_new_matched_tokens: only params with `do_remote_prefill` and every remote field ask a remote prefill)."""

    def get_num_new_matched_tokens(self, num_prompt_tokens: int, num_local: int, params: dict[str, Any] | None
                                   ) -> tuple[int, bool]:
        count = num_prompt_tokens - num_local
        asks = bool(params and params.get("do_remote_prefill") and isinstance(params.get("remote_block_ids"), list))
        return (count, True) if asks and count > 0 else (0, False)

    def complete_transfers(self, fail: bool) -> None:
        for load in self.in_flight.values():  # read what the malformed params lead to: no engine, no request
            load.params = {"remote_engine_id": None, "remote_request_id": None, **load.params}
        super().complete_transfers(fail)


class IgnoresLocalHitConsumer(ConsumerConnector):
    """Answers the whole prompt as the remote load, its count not less the consumer's own prefix-cache hit (NIXL's
    `len(prompt) - num_computed_tokens` without the hit; vLLM PR #18632, a
    local prefix hit on D mishandled by NixlConnector; PR #50558, D's blocks and P's out of step under prefix
    caching)."""

    def get_num_new_matched_tokens(self, num_prompt_tokens: int, num_local: int, params: dict[str, Any] | None
                                   ) -> tuple[int, bool]:
        return super().get_num_new_matched_tokens(num_prompt_tokens, 0, params)


class FailureReportedAsSuccessConsumer(ConsumerConnector):
    """A failed read reported as a finished receive without its failure: the request decodes on KV it never got
    (vLLM PR #52232: a failed HMA receive reported finished without any failure signal)."""

    def complete_transfers(self, fail: bool) -> None:
        super().complete_transfers(fail)
        for output in self.completed:
            output.failed_recving.clear()


class ReadsOtherRankHeadsConsumer(ConsumerConnector):
    """Every rank reads rank 0's heads into its own (a TP mapping that ignores the rank: vLLM #32375, TP with
    NixlConnector; PR #23917, heterogeneous TP)."""

    def read_columns(self, rank: int) -> slice:
        return heads(0, self.world_size, self.gpu.shape[2])


class ReadsWrongBlocksConsumer(ConsumerConnector):
    """Reads the remote blocks into its blocks one further on: the loaded KV sits where the prompt's next tokens go
    (vLLM #28951's offset error, on the P/D read)."""

    def update_state_after_alloc(self, request_id: str, block_ids: list[int], num_local_blocks: int,
                                 params: dict[str, Any]) -> None:
        super().update_state_after_alloc(request_id, block_ids, num_local_blocks, params)
        load = self.pending[request_id]
        if len(load.local_block_ids) > 1:
            load.local_block_ids = load.local_block_ids[1:] + load.local_block_ids[:1]


class OneRankAggregator(Aggregator):
    """Counts one rank: an id is finished as soon as any rank reported it (vLLM PR #19330: the scheduler saw only the
    first rank's `finished_recving`, the executor discarding the others' outputs)."""

    def aggregate(self, outputs: Sequence[RankOutput]) -> RankOutput:
        reported: set[str] = self.__dict__.setdefault("reported", set())
        done = RankOutput()
        for output in outputs:
            done.finished_sending |= output.finished_sending
            done.finished_recving |= output.finished_recving - reported
            done.failed_recving |= output.failed_recving
        done.failed_recving &= done.finished_recving
        reported |= done.finished_recving  # the later ranks' reports of it are dropped
        return done


class ForgetsFailureAggregator(Aggregator):
    """Forgets a rank's failed receive reported before the other ranks finished it (vLLM PR #52232: "failure and
    completion notifications split across scheduler steps"; the TP 2 failed read the earlier kit found lost)."""

    def aggregate(self, outputs: Sequence[RankOutput]) -> RankOutput:
        self.failed = set()
        return super().aggregate(outputs)


class OneRankConsumer(ConsumerConnector):
    """A consumer whose aggregation counts one rank (`OneRankAggregator`)."""

    def __init__(self, gpu: torch.Tensor, world_size: int, *args: Any) -> None:
        super().__init__(gpu, world_size, *args)
        self.aggregator = OneRankAggregator(world_size)


class ForgetsFailureConsumer(ConsumerConnector):
    """A consumer whose aggregation forgets an early rank's failure (`ForgetsFailureAggregator`)."""

    def __init__(self, gpu: torch.Tensor, world_size: int, *args: Any) -> None:
        super().__init__(gpu, world_size, *args)
        self.aggregator = ForgetsFailureAggregator(world_size)
