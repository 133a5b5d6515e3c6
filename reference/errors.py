"""The one exception the reference raises: a call the spec does not allow."""

from __future__ import annotations


class InvalidCall(Exception):
    """A precondition of the named clause does not hold; the call is invalid."""

    def __init__(self, clause: str, message: str) -> None:
        super().__init__(f"[{clause}] {message}")
        self.clause = clause
