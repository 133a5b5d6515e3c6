"""The reference P/D connector pair (reference/disaggregated.py): a producer's KV reaches the consumer byte for byte,
each rank moving only its heads, reported once every rank did, the producer's blocks held until the read or lease."""

from __future__ import annotations

import pytest
import torch

from kvconform.reference.disaggregated import (
    LEASE_STEPS,
    Aggregator,
    ConsumerConnector,
    ProducerConnector,
    RankOutput,
    Transport,
)
from kvconform.reference.errors import InvalidCall

BLOCKS, BLOCK_SIZE, WIDTH = 8, 4, 8


def pair(world_size: int) -> tuple[ProducerConnector, ConsumerConnector]:
    transport = Transport()
    producer_gpu = torch.arange(BLOCKS * BLOCK_SIZE * WIDTH, dtype=torch.float32).reshape(BLOCKS, BLOCK_SIZE, WIDTH)
    producer = ProducerConnector("prefill-0", producer_gpu, world_size, transport)
    return producer, ConsumerConnector(torch.zeros(BLOCKS, BLOCK_SIZE, WIDTH), world_size, transport)


def prefill(producer: ProducerConnector) -> dict:
    delay, params = producer.request_finished("p0", [2, 3], {"do_remote_decode": True}, finished_normally=True)
    assert delay and params is not None
    assert params["remote_block_ids"] == [2, 3] and params["remote_engine_id"] == "prefill-0"
    return params


@pytest.mark.parametrize("world_size", [1, 2])
def test_consumer_loads_the_producers_kv_and_frees_it(world_size: int) -> None:
    """PD-PARAMS-1, PD-LOAD-1, PD-DATA-1, PD-HOLD-1, PD-ONCE-1, PD-TP-1: the prompt's KV moves once, then is freed."""
    producer, consumer = pair(world_size)
    params = prefill(producer)
    assert consumer.get_num_new_matched_tokens(8, 0, params) == (8, True)
    consumer.update_state_after_alloc("d0", [5, 6], 0, params)
    consumer.start_load_kv()
    assert producer.step().finished_sending == set()  # held until the read
    consumer.complete_transfers(fail=False)
    reports = [consumer.get_finished() for _ in range(world_size)]  # rank r reports r calls late
    assert [report.finished_recving for report in reports] == [set()] * (world_size - 1) + [{"d0"}]
    assert not reports[-1].failed_recving and not consumer.reports_pending()
    assert torch.equal(consumer.gpu[[5, 6]], producer.gpu[[2, 3]])
    assert consumer.get_finished().finished_recving == set()  # exactly once (PD-ONCE-1)
    assert producer.step().finished_sending == {"p0"} and not producer.held


def test_failed_or_misdirected_reads_are_reported_failed() -> None:
    """PD-FAIL-1: an unknown engine, or blocks the producer does not hold, fail the receive."""
    producer, consumer = pair(2)
    params = prefill(producer)
    consumer.update_state_after_alloc("d0", [5, 6], 0, {**params, "remote_engine_id": "nowhere"})
    consumer.update_state_after_alloc("d1", [1, 4], 0, {**params, "remote_block_ids": [2, 7]})
    consumer.start_load_kv()
    consumer.complete_transfers(fail=False)
    consumer.get_finished()
    done = consumer.get_finished()
    assert done.finished_recving == done.failed_recving == {"d0", "d1"}
    assert not consumer.gpu.any()


def test_malformed_params_get_no_load() -> None:
    """PD-PARAMS-2, PD-LOAD-1: missing fields, or no do_remote_prefill, and the request computes locally."""
    producer, consumer = pair(1)
    params = prefill(producer)
    assert consumer.get_num_new_matched_tokens(8, 0, {"do_remote_prefill": True}) == (0, False)
    assert consumer.get_num_new_matched_tokens(8, 0, {**params, "do_remote_prefill": False}) == (0, False)
    assert consumer.get_num_new_matched_tokens(8, 0, None) == (0, False)
    assert consumer.get_num_new_matched_tokens(8, 4, params) == (4, True)


def test_the_lease_ends_an_unread_hold_and_an_abort_holds_nothing() -> None:
    """PD-LEASE-1, PD-ABORT-1."""
    producer, _ = pair(2)
    prefill(producer)
    assert producer.request_finished("p1", [4], {"do_remote_decode": True}, finished_normally=False) == (False, None)
    reports = [producer.step().finished_sending for _ in range(LEASE_STEPS)]
    assert reports[-1] == {"p0"} and not any(reports[:-1]) and not producer.held


def test_aggregation_waits_for_every_rank() -> None:
    """PD-TP-1: an id is finished only once every rank reported it; a failure rides with its receive."""
    aggregator = Aggregator(2)
    first = aggregator.aggregate([RankOutput(finished_recving={"a"}, failed_recving={"a"}), RankOutput()])
    assert first.finished_recving == set()
    second = aggregator.aggregate([RankOutput(), RankOutput(finished_recving={"a"})])
    assert second.finished_recving == second.failed_recving == {"a"}
    with pytest.raises(InvalidCall, match="PD-TP-1"):
        aggregator.aggregate([RankOutput()])


def test_a_hold_ends_only_on_every_ranks_notification() -> None:
    """PD-NOTIFY-1: one rank's notification keeps the hold; one for a request not held is ignored."""
    producer, _ = pair(2)
    prefill(producer)
    producer.transport.notifications["prefill-0"] += [("p0", 0), ("stranger", 0), ("stranger", 1)]
    assert producer.step().finished_sending == set() and "p0" in producer.held
    producer.transport.notifications["prefill-0"].append(("p0", 1))
    assert producer.step().finished_sending == {"p0"} and not producer.held
