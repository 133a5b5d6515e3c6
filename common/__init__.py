"""Neutral ground: the values of the adapter contract and the KV content function, shared by the reference, the adapters and the kit."""
