"""The forwarding rule of a P/D proxy (chapter `disaggregated`): what a `decode` sends the consumer.

A pair's adapter forwards with it, as a P/D proxy does, and the disaggregated level's judge computes the same params
with it from what the producer returned, so the two cannot disagree on what was sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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
