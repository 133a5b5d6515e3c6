"""Neutral ground: the values of the adapter contract, the KV content function and a P/D proxy's forwarding rule, for
the reference, the adapters and the kit alike."""
