"""The kv_transfer_params of a P/D pair (chapter `disaggregated`), as a proxy forwards them from the producer to the
consumer: the one statement of what a consumer's params must carry, and of what a `decode` sends the consumer. A
pair's adapter forwards with it, as a P/D proxy does, and the judge computes the same params with it from what the
producer returned, so the two cannot disagree on what was sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_block_ids")
"""What a consumer's kv_transfer_params must carry, besides `do_remote_prefill`, to load (PD-PARAMS-2)."""


def missing_fields(params: Mapping[str, Any] | None) -> list[str]:
    """Return the fields params that ask a remote prefill lack for the load; none for params that ask none."""
    if not params or not params.get("do_remote_prefill"):
        return []
    return [name for name in REMOTE_FIELDS if name not in params]


def valid_params(params: Mapping[str, Any] | None) -> bool:
    """Return True if params ask a remote prefill and carry what the load needs (PD-PARAMS-2)."""
    return bool(params and params.get("do_remote_prefill")) and not missing_fields(params)


def forwarded_params(returned: Mapping[str, Any] | None, override: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the params a proxy forwards to the consumer: what the producer returned, each field of `override`
    replacing it, a None value removing it (a malformed forward, PD-PARAMS-2)."""
    params = dict(returned or {})
    for name, value in (override or {}).items():
        if value is None:
            params.pop(name, None)
        else:
            params[name] = value
    return params


def block_ids(value: Any) -> tuple[int, ...] | None:
    """Return the block ids params name: a list, or vLLM's one list per KV-cache group (`([1, 2],)`) of one group;
    None for anything else."""
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = value[0]
    if isinstance(value, (list, tuple)) and all(isinstance(block, int) for block in value):
        return tuple(value)
    return None
