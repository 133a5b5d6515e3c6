"""Adapters: the contract, the reference adapter, and adapters for real implementations."""
