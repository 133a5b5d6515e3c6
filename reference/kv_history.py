"""The history of KV an engine computed, and what it allows a connector to answer (chapter `connector-level`).

The connector level judges any connector on the engine's own schedule: it never decides which request runs.
What it needs is the history this class keeps — every token prefix, per tenant, whose KV the engine has
computed (or received, byte-checked) — and the sequences requests decode, which the KV content function fixes:
request `r`'s tokens are its prompt followed by `next_token` of each last chain state (XFER-DATA-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvconform.common import kv_content

Tenant = tuple[str | None, str | None]
"""(cache_salt, lora_name): requests share cached KV only within one tenant (KVC-HIT-1)."""


@dataclass
class RequestHistory:
    """One request's tenant and the tokens it has, as far as the engine has reached."""

    tenant: Tenant
    prompt: tuple[int, ...]
    max_tokens: int
    states: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def max_kv_tokens(self) -> int:
        """Return the most tokens this request can have KV for: the last output token is never computed."""
        return len(self.prompt) + self.max_tokens - 1

    def decoded(self) -> list[int]:
        """Return the prompt followed by every token the request decodes, the last one included (XFER-DATA-2)."""
        self.extend(len(self.prompt) + self.max_tokens)
        return list(self.tokens)

    def extend(self, num_tokens: int) -> None:
        """Derive tokens and chain states up to `num_tokens` (XFER-DATA-1, XFER-DATA-2)."""
        if not self.tokens:
            self.tokens = list(self.prompt)
        while len(self.states) < num_tokens:
            if len(self.tokens) <= len(self.states):
                self.tokens.append(kv_content.next_token(self.states[-1]))
            initial = kv_content.initial_state(self.tenant[1], self.tenant[0])
            self.states = kv_content.token_states(initial, self.tokens[: len(self.states) + 1], self.states)


@dataclass
class KVHistory:
    """Which token prefixes of which tenant have KV the engine computed: the only source a hit may come from."""

    requests: dict[str, RequestHistory] = field(default_factory=dict)
    computed: dict[Tenant, set[tuple[int, ...]]] = field(default_factory=dict)

    def add(self, request_id: str, prompt: tuple[int, ...], max_tokens: int, cache_salt: str | None,
            lora_name: str | None) -> None:
        """Track a new request."""
        self.requests[request_id] = RequestHistory((cache_salt, lora_name), tuple(prompt), max_tokens)

    def sampled(self, request_id: str, output: tuple[int, ...]) -> None:
        """Take a request's output tokens as the engine's own model sampled them, in place of the kit's model's:
        the prefixes it computes are of these tokens (KVC-HIT-1)."""
        request = self.requests[request_id]
        request.tokens = [*request.prompt, *output]
        request.states = request.states[: len(request.prompt)]

    def prefix(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Return a request's first `num_tokens` tokens."""
        request = self.requests[request_id]
        request.extend(num_tokens)
        return tuple(request.tokens[:num_tokens])

    def record_computed(self, request_id: str, num_tokens: int) -> None:
        """Record that the engine holds KV for a request's first `num_tokens` tokens, and so for every shorter
        prefix."""
        request = self.requests[request_id]
        known = self.computed.setdefault(request.tenant, set())
        tokens = self.prefix(request_id, num_tokens)
        for length in range(num_tokens, 0, -1):
            if tokens[:length] in known:
                break
            known.add(tokens[:length])

    def was_computed(self, request_id: str, num_tokens: int) -> bool:
        """Return True if KV for a request's first `num_tokens` tokens was computed before, in its tenant
        (KVC-HIT-1)."""
        if num_tokens == 0:
            return True
        request = self.requests[request_id]
        return self.prefix(request_id, num_tokens) in self.computed.get(request.tenant, set())

    def expected_kv(self, request_id: str, num_tokens: int, token_width: int, dtype: torch.dtype) -> torch.Tensor:
        """Return the KV rows a request's first `num_tokens` tokens must hold (KVC-DATA-1)."""
        request = self.requests[request_id]
        request.extend(num_tokens)
        return kv_content.kv_values(request.states[:num_tokens], token_width, dtype)
