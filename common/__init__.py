"""Neutral ground: the values of the adapter contract and the KV content function, for the reference, the adapters
and the kit alike."""
