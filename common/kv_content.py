"""The KV content function: what a forward pass writes for each token (spec chapter `transfer`).

Every token's KV bytes are a deterministic function of the request's extra keys and the token
prefix up to and including it (XFER-DATA-1), so any block's bytes can be checked anywhere.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import torch

KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""The KV element types, by the name `EngineConfig.kv_dtype` gives them."""

VOCAB_SIZE = 4
"""Sampled tokens lie in range(VOCAB_SIZE): small, so decoded continuations collide and share blocks."""

_MASK = (1 << 31) - 1
_MULTIPLIER = 1_000_003
_ELEMENT_PRIME = 65_521
_ELEMENT_MULTIPLIER = 2_654_435_761


def initial_state(lora_name: str | None, cache_salt: str | None) -> int:
    """Return the chain state before the first token (XFER-DATA-1)."""
    seed = f"{lora_name or ''}\x00{cache_salt or ''}".encode()
    return int.from_bytes(hashlib.blake2b(seed, digest_size=4).digest(), "little") & _MASK


def token_states(initial: int, tokens: Sequence[int], known: Sequence[int] = ()) -> list[int]:
    """Return the chain state after each token, extending the `known` ones (XFER-DATA-1)."""
    states = list(known)
    state = states[-1] if states else initial
    for token in tokens[len(states) :]:
        state = ((state * _MULTIPLIER) ^ (token + 1)) & _MASK
        states.append(state)
    return states


def next_token(state: int) -> int:
    """Return the token sampled after a token whose chain state is `state` (XFER-DATA-2)."""
    return state % VOCAB_SIZE


def kv_values(states: Sequence[int], token_width: int, dtype: torch.dtype) -> torch.Tensor:
    """Return the KV rows `[len(states), token_width]` that a forward writes for these tokens (XFER-DATA-1).

    Element `j` of the row of a token whose chain state is `s` is `((s + j) * M mod P) / P`, written as
    `(s·M mod P + j·M mod P) mod P`, looked up in a table of the `P` possible values.
    """
    rows = torch.tensor([state * _ELEMENT_MULTIPLIER % _ELEMENT_PRIME for state in states], dtype=torch.int64)
    rows = rows.unsqueeze(1)
    return _element_values(dtype)[(rows + _column_residues(token_width)) % _ELEMENT_PRIME]


@functools.cache
def _column_residues(token_width: int) -> torch.Tensor:
    return torch.arange(token_width, dtype=torch.int64) * _ELEMENT_MULTIPLIER % _ELEMENT_PRIME


@functools.cache
def _element_values(dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(_ELEMENT_PRIME, dtype=torch.float32) / _ELEMENT_PRIME).to(dtype)
